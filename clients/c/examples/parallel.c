/* A parallel loop under the broker's limit: 8 threads share 24 iterations,
 * and each iteration runs while holding one token, so however many threads
 * there are, no more iterations run at once than the broker allows (and
 * the limit is shared with every build on the machine).
 *
 *   baton serve --jobs 2 &
 *   cc parallel.c $(pkg-config --cflags --libs baton) -lpthread -o parallel
 *   ./parallel
 */
#include <baton.h>

#include <err.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#define THREADS 8
#define ITERATIONS 24

static atomic_int next, running, peak;
static atomic_long sum;

static void work(int i) {
    nanosleep(&(struct timespec){0, 20 * 1000000}, NULL); /* the job */
    atomic_fetch_add(&sum, (long)i * i);
}

static void *loop(void *arg) {
    (void)arg;
    /* One connection per thread: a waiting acquire holds its connection. */
    baton_t *c = baton_connect(NULL, "parallel example", NULL);
    if (!c) err(1, "baton_connect");
    for (int i; (i = atomic_fetch_add(&next, 1)) < ITERATIONS;) {
        if (baton_acquire(c, 1, NULL) < 0) err(1, "baton_acquire");
        int now = atomic_fetch_add(&running, 1) + 1;
        for (int p = atomic_load(&peak); now > p && !atomic_compare_exchange_weak(&peak, &p, now);) {
        }
        work(i);
        atomic_fetch_sub(&running, 1);
        if (baton_release(c, 1, NULL) < 0) err(1, "baton_release");
    }
    baton_close(c);
    return NULL;
}

int main(void) {
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++)
        if (pthread_create(&threads[i], NULL, loop, NULL) != 0) errx(1, "pthread_create");
    for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
    printf("%d iterations, sum of squares %ld, at most %d at once\n", ITERATIONS, atomic_load(&sum), atomic_load(&peak));
    return 0;
}
