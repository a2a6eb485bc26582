//! `baton top`: the broker's builds live, drawn with ratatui on its
//! crossterm backend. It asks for STATUS four times a second over one
//! connection (a few kilobytes of JSON for a machine's worth of builds;
//! about 300 KB for a thousand clients), and reconnects when the broker
//! goes away and comes back.

use anyhow::{bail, Result};
use baton_client::{Client, Status};
use baton_core::status::Build;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Block, Clear, Paragraph, Row, Sparkline, Table, TableState, Wrap};
use ratatui::{DefaultTerminal, Frame};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often the view asks the broker.
const REFRESH: Duration = Duration::from_millis(250);

pub fn run(socket: &Path) -> Result<()> {
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        bail!("top needs a terminal (in a script, use: baton status --json, or baton status --prometheus)");
    }
    let mut terminal = ratatui::try_init()?;
    let result = Top::new(socket).run(&mut terminal);
    ratatui::restore();
    result
}

/// The columns builds can be sorted by, in the order `s` steps through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sort {
    Held,
    Waiting,
    Name,
    Weight,
    Grants,
    WaitP50,
    WaitP99,
    Running,
}

impl Sort {
    const ALL: [Sort; 8] = [
        Sort::Held,
        Sort::Waiting,
        Sort::Name,
        Sort::Weight,
        Sort::Grants,
        Sort::WaitP50,
        Sort::WaitP99,
        Sort::Running,
    ];

    fn next(self) -> Sort {
        let i = Sort::ALL.iter().position(|&s| s == self).expect("listed");
        Sort::ALL[(i + 1) % Sort::ALL.len()]
    }

    fn name(self) -> &'static str {
        match self {
            Sort::Held => "held",
            Sort::Waiting => "waiting",
            Sort::Name => "name",
            Sort::Weight => "weight",
            Sort::Grants => "grants",
            Sort::WaitP50 => "wait p50",
            Sort::WaitP99 => "wait p99",
            Sort::Running => "running",
        }
    }

    /// Largest first, except names, which read best from A.
    fn order(self, a: &Build, b: &Build) -> std::cmp::Ordering {
        let ms = |v: Option<f64>| v.unwrap_or(-1.0);
        match self {
            Sort::Held => b.held.cmp(&a.held),
            Sort::Waiting => b.waiting.cmp(&a.waiting),
            Sort::Name => a.name.cmp(&b.name),
            Sort::Weight => b.weight.cmp(&a.weight),
            Sort::Grants => b.grants.cmp(&a.grants),
            Sort::WaitP50 => ms(b.wait_ms_p50).total_cmp(&ms(a.wait_ms_p50)),
            Sort::WaitP99 => ms(b.wait_ms_p99).total_cmp(&ms(a.wait_ms_p99)),
            Sort::Running => a.since.total_cmp(&b.since),
        }
    }
}

/// The view's state between frames.
struct Top {
    socket: PathBuf,
    client: Option<Client>,
    /// The last status the broker sent.
    status: Option<Status>,
    /// Why the last attempt to reach the broker failed, while it fails.
    gone: Option<String>,
    sort: Sort,
    reversed: bool,
    /// The selected build, by id, so that it stays selected as rows move.
    selected: Option<u64>,
    help: bool,
    /// The answer to the last key that asked the broker something.
    message: String,
}

impl Top {
    fn new(socket: &Path) -> Self {
        Top {
            socket: socket.to_path_buf(),
            client: None,
            status: None,
            gone: None,
            sort: Sort::Held,
            reversed: false,
            selected: None,
            help: false,
            message: String::new(),
        }
    }

    fn run(mut self, terminal: &mut DefaultTerminal) -> Result<()> {
        let mut asked = Instant::now() - REFRESH;
        loop {
            if asked.elapsed() >= REFRESH {
                self.refresh();
                asked = Instant::now();
            }
            terminal.draw(|frame| self.draw(frame))?;
            // A resize is an event too: the next draw fits the new size.
            if event::poll(REFRESH.saturating_sub(asked.elapsed()))? {
                if let Event::Key(key) = event::read()? {
                    if key.kind == KeyEventKind::Press && !self.key(key) {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Asks the broker for its status, connecting first if need be.
    fn refresh(&mut self) {
        if let Err(e) = self
            .ask(|client| client.status())
            .map(|s| self.status = Some(s))
        {
            self.gone = Some(e.to_string());
        }
    }

    /// One request over the connection; a failure drops it, so that the
    /// next request connects anew (the broker may have been restarted).
    fn ask<T>(
        &mut self,
        request: impl FnOnce(&mut Client) -> baton_client::Result<T>,
    ) -> Result<T> {
        if self.client.is_none() {
            self.client = Some(Client::connect(&self.socket, "baton top")?);
        }
        let result = request(self.client.as_mut().expect("connected above"));
        match result {
            Ok(value) => {
                self.gone = None;
                Ok(value)
            }
            Err(e) => {
                self.client = None;
                Err(e.into())
            }
        }
    }

    /// Handles a key; false to quit.
    fn key(&mut self, key: KeyEvent) -> bool {
        if self.help && key.code != KeyCode::Char('q') {
            self.help = false;
            return true;
        }
        match key.code {
            KeyCode::Char('q') | KeyCode::Esc => return false,
            KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => return false,
            KeyCode::Char('+') => self.change_limit(1),
            KeyCode::Char('-') => self.change_limit(-1),
            KeyCode::Up => self.select(-1),
            KeyCode::Down => self.select(1),
            KeyCode::Char('s') => self.sort = self.sort.next(),
            KeyCode::Char('r') => self.reversed = !self.reversed,
            KeyCode::Char('?') | KeyCode::Char('h') => self.help = true,
            _ => {}
        }
        true
    }

    /// `baton limit` with the limit one up or down.
    fn change_limit(&mut self, by: i64) {
        let Some(limit) = self.status.as_ref().map(|s| i64::from(s.limit) + by) else {
            return;
        };
        let Ok(limit) = u32::try_from(limit.max(1)) else {
            return;
        };
        self.message = match self.ask(|client| client.set_limit(limit)) {
            Ok(old) => limit_changed(old, limit),
            Err(e) => format!("limit not changed: {e}"),
        };
        self.refresh();
    }

    /// Moves the selection by `by` rows.
    fn select(&mut self, by: isize) {
        let rows = self.rows();
        if rows.is_empty() {
            return;
        }
        let at = self
            .selected
            .and_then(|id| rows.iter().position(|b| b.id == id));
        let next = match at {
            Some(i) => i.saturating_add_signed(by).min(rows.len() - 1),
            None => 0,
        };
        self.selected = Some(rows[next].id);
    }

    /// The builds worth a row: those that hold, wait or were granted
    /// tokens (not idle clients such as this view's own), in the chosen
    /// order.
    fn rows(&self) -> Vec<&Build> {
        let Some(status) = &self.status else {
            return Vec::new();
        };
        let mut rows: Vec<&Build> = status
            .builds
            .iter()
            .filter(|b| b.held + b.waiting > 0 || b.grants > 0)
            .collect();
        rows.sort_by(|a, b| self.sort.order(a, b).then(a.id.cmp(&b.id)));
        if self.reversed {
            rows.reverse();
        }
        rows
    }

    fn draw(&self, frame: &mut Frame) {
        // The answer to + or - gets lines of its own, as many as a narrow
        // terminal needs to show it whole.
        let width = usize::from(frame.area().width.max(1));
        let message_lines = self.message.chars().count().div_ceil(width);
        let footer_lines = 1 + u16::try_from(message_lines).unwrap_or(1);
        let [header, builds, holders, history, footer] = Layout::vertical([
            Constraint::Length(3),
            Constraint::Min(4),
            Constraint::Length(7),
            Constraint::Length(6),
            Constraint::Length(footer_lines),
        ])
        .areas(frame.area());
        frame.render_widget(Paragraph::new(self.header()), header);
        let rows = self.rows();
        let selected = self
            .selected
            .and_then(|id| rows.iter().position(|b| b.id == id))
            .or(if rows.is_empty() { None } else { Some(0) });
        self.draw_builds(frame, builds, &rows, selected);
        self.draw_holders(frame, holders, selected.map(|i| rows[i]));
        self.draw_history(frame, history);
        let keys = format!(
            "q quit  +/- limit  ↑↓ select  s sort ({}{})  ? help",
            self.sort.name(),
            if self.reversed { ", reversed" } else { "" },
        );
        let [message, keys_line] =
            Layout::vertical([Constraint::Fill(1), Constraint::Length(1)]).areas(footer);
        frame.render_widget(
            Paragraph::new(self.message.clone())
                .bold()
                .wrap(Wrap { trim: true }),
            message,
        );
        frame.render_widget(
            Paragraph::new(keys).style(Style::new().add_modifier(Modifier::REVERSED)),
            keys_line,
        );
        if self.help {
            draw_help(frame);
        }
    }

    fn header(&self) -> Vec<Line<'static>> {
        let mut lines = Vec::new();
        match &self.gone {
            // Never reached: the client's error names the path and how
            // to start a broker there.
            Some(why) if self.status.is_none() => lines.push(
                Line::from(format!("{why}; retrying")).style(Style::new().fg(Color::Red).bold()),
            ),
            Some(why) => lines.push(
                Line::from(format!("broker gone, retrying ({why})"))
                    .style(Style::new().fg(Color::Red).bold()),
            ),
            None => lines.push(Line::from(format!("baton top  {}", self.socket.display()))),
        }
        let Some(s) = &self.status else { return lines };
        lines.push(Line::from(format!(
            "limit {}  free {}  held {}  waiting {}  clients {}  granted {}  (broker pid {})",
            s.limit,
            s.free,
            s.held,
            s.waiters.iter().map(|w| w.tokens).sum::<u32>(),
            s.totals.clients,
            s.totals.granted,
            s.broker_pid
        )));
        let gates: Vec<String> = s
            .gates
            .iter()
            .map(|g| {
                format!(
                    "{} {} ({} / {})",
                    g.name,
                    if g.open { "open" } else { "CLOSED" },
                    g.value.map_or("n/a".into(), |v| format!("{v:.1}")),
                    g.threshold
                )
            })
            .collect();
        if !gates.is_empty() {
            lines.push(Line::from(format!("gates: {}", gates.join("  "))));
        }
        lines
    }

    fn draw_builds(&self, frame: &mut Frame, area: Rect, rows: &[&Build], selected: Option<usize>) {
        let now = now();
        // Inside the border.
        let columns = columns_that_fit(area.width.saturating_sub(2));
        let header = Row::new(columns.iter().map(|c| c.header)).bold();
        let body = rows
            .iter()
            .map(|b| Row::new(columns.iter().map(|c| (c.cell)(b, now))));
        let widths = columns.iter().map(|c| match c.header {
            "NAME" => Constraint::Min(c.width),
            _ => Constraint::Length(c.width),
        });
        let table = Table::new(body, widths)
            .header(header)
            .block(Block::bordered().title(" builds "))
            .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED));
        frame.render_stateful_widget(table, area, &mut TableState::new().with_selected(selected));
    }

    /// Who in the selected build holds tokens, and since when; with none,
    /// a line that says so.
    fn draw_holders(&self, frame: &mut Frame, area: Rect, build: Option<&Build>) {
        let now = now();
        let holders: Vec<_> = self
            .status
            .iter()
            .flat_map(|s| &s.holders)
            .filter(|h| build.is_some_and(|b| b.id == h.build))
            .collect();
        if holders.is_empty() {
            let (title, text) = match build {
                Some(b) => (
                    format!(" holders of {} ", b.name),
                    format!("{} holds no tokens now", b.name),
                ),
                None => (
                    " holders ".to_string(),
                    "no build holds or waits for tokens: the holders of the selected build show here"
                        .to_string(),
                ),
            };
            let empty = Paragraph::new(text).block(Block::bordered().title(title));
            frame.render_widget(empty, area);
            return;
        }
        let body = holders.into_iter().map(|h| {
            Row::new([
                h.pid.to_string(),
                h.tokens.to_string(),
                show_seconds(now - h.since),
                crate::status::holder_command(h),
            ])
        });
        let title = format!(" holders of {} ", build.map_or("", |b| b.name.as_str()));
        let widths = [
            Constraint::Length(8),
            Constraint::Length(6),
            Constraint::Length(9),
            Constraint::Fill(1),
        ];
        let table = Table::new(body, widths)
            .header(Row::new(["PID", "TOKENS", "SINCE", "COMMAND"]).bold())
            .block(Block::bordered().title(title));
        frame.render_widget(table, area);
    }

    /// Mean tokens held per second, as many of the last seconds as fit,
    /// scaled to the limit.
    fn draw_history(&self, frame: &mut Frame, area: Rect) {
        let Some(s) = &self.status else { return };
        let width = usize::from(area.width.saturating_sub(2));
        let held = &s.utilization.held;
        let shown = &held[held.len().saturating_sub(width)..];
        // Hundredths, so that a mean of 0.4 tokens still shows.
        let data: Vec<u64> = shown.iter().map(|&h| (h * 100.0).round() as u64).collect();
        let title = format!(
            " tokens held, last {} (top = limit {}) ",
            show_seconds(shown.len() as f64 * s.utilization.interval_s),
            s.limit
        );
        let sparkline = Sparkline::default()
            .block(Block::bordered().title(title))
            .data(&data)
            .max(u64::from(s.limit) * 100)
            .style(Style::new().fg(Color::Green));
        frame.render_widget(sparkline, area);
    }
}

fn draw_help(frame: &mut Frame) {
    let text = [
        "q, Esc      quit",
        "+ / -       raise / lower the broker's limit by one, for every build",
        "            (as baton limit; the other key, or baton limit N, undoes it)",
        "↑ / ↓       select a build: its holders show below",
        "s           sort by the next column; r reverses",
        "?           this help; any key closes it",
        "",
        "WAIT p50/p99: how long the build's requests waited for a token",
        "(0 when granted at once). GRANTS: tokens given to it so far.",
    ];
    let area = frame.area();
    let (w, h) = (area.width.min(72), area.height.min(text.len() as u16 + 2));
    let popup = Rect {
        x: area.x + (area.width - w) / 2,
        y: area.y + (area.height - h) / 2,
        width: w,
        height: h,
    };
    frame.render_widget(Clear, popup);
    frame.render_widget(
        Paragraph::new(text.join("\n")).block(Block::bordered().title(" baton top ")),
        popup,
    );
}

/// A column of the builds table.
struct Column {
    header: &'static str,
    /// Never less than the header's, so that a header shows whole.
    width: u16,
    /// When the terminal is too narrow for every column, the highest rank
    /// goes first; NAME and HELD (0) stay.
    drop_rank: u8,
    cell: fn(&Build, f64) -> String,
}

const COLUMNS: [Column; 9] = [
    Column {
        header: "NAME",
        width: 8,
        drop_rank: 0,
        cell: |b, _| format!("{}{}", b.name, crate::status::place(b)),
    },
    Column {
        header: "WEIGHT",
        width: 6,
        drop_rank: 5,
        cell: |b, _| b.weight.to_string(),
    },
    Column {
        header: "HELD",
        width: 6,
        drop_rank: 0,
        cell: |b, _| b.held.to_string(),
    },
    // Jobs counted from the build's processes: more than HELD is a tool
    // running past its tokens (a sub-make with its own -jN).
    Column {
        header: "JOBS",
        width: 5,
        drop_rank: 1,
        cell: |b, _| b.running.map_or("-".into(), |n| n.to_string()),
    },
    Column {
        header: "WAITING",
        width: 7,
        drop_rank: 2,
        cell: |b, _| b.waiting.to_string(),
    },
    Column {
        header: "GRANTS",
        width: 8,
        drop_rank: 4,
        cell: |b, _| b.grants.to_string(),
    },
    Column {
        header: "WAIT p50",
        width: 9,
        drop_rank: 3,
        cell: |b, _| b.wait_ms_p50.map_or("-".into(), show_ms),
    },
    Column {
        header: "WAIT p99",
        width: 9,
        drop_rank: 6,
        cell: |b, _| b.wait_ms_p99.map_or("-".into(), show_ms),
    },
    Column {
        header: "RUNNING",
        width: 9,
        drop_rank: 7,
        cell: |b, now| show_seconds(now - b.since),
    },
];

/// The columns that fit in `width` cells with their headers whole (one
/// cell between columns): a narrow terminal loses whole columns, least
/// telling first, rather than the ends of every header.
fn columns_that_fit(width: u16) -> Vec<&'static Column> {
    let mut shown: Vec<&Column> = COLUMNS.iter().collect();
    let needed = |cols: &[&Column]| cols.iter().map(|c| c.width + 1).sum::<u16>();
    while needed(&shown) > width {
        let Some((at, _)) = shown
            .iter()
            .enumerate()
            .filter(|(_, c)| c.drop_rank > 0)
            .max_by_key(|(_, c)| c.drop_rank)
        else {
            break;
        };
        shown.remove(at);
    }
    shown
}

/// What `+` or `-` did to the limit and how to take it back; short
/// enough for 50 columns (the help says the limit is every build's).
fn limit_changed(old: u32, new: u32) -> String {
    let undo = match new.cmp(&old) {
        std::cmp::Ordering::Greater => "-",
        std::cmp::Ordering::Less => "+",
        std::cmp::Ordering::Equal => return format!("limit stays {new}"),
    };
    format!("limit {old} -> {new} (undo: {undo}, or baton limit {old})")
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A wait as people read it: 0, 850us, 12ms, 1.5s, 2m05s.
fn show_ms(ms: f64) -> String {
    match ms {
        0.0 => "0".into(),
        ms if ms < 1.0 => format!("{:.0}us", ms * 1000.0),
        ms if ms < 1000.0 => format!("{ms:.0}ms"),
        ms => show_seconds(ms / 1000.0),
    }
}

/// A span of seconds: 4.2s, 3m07s, 2h05m.
fn show_seconds(secs: f64) -> String {
    let secs = secs.max(0.0);
    let whole = secs as u64;
    match whole {
        0..=59 => format!("{secs:.1}s"),
        60..=3599 => format!("{}m{:02}s", whole / 60, whole % 60),
        _ => format!("{}h{:02}m", whole / 3600, whole % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    fn build(id: u64, name: &str, held: u32, grants: u64) -> Build {
        Build {
            id,
            name: name.into(),
            pid: 100 + id as u32,
            weight: 1,
            held,
            waiting: 0,
            grants,
            token_seconds: 0.0,
            since: now(),
            waits: 0,
            wait_ms_total: 0.0,
            wait_ms_p50: None,
            wait_ms_p99: None,
            running: None,
            stray: 0,
            uid: None,
            cgroup: None,
        }
    }

    fn top_with(builds: Vec<Build>) -> Top {
        let mut top = Top::new(Path::new("/nowhere/socket"));
        let status = Status {
            version: 1,
            broker_pid: 1,
            limit: 8,
            free: 8,
            held: 0,
            holders: Vec::new(),
            waiters: Vec::new(),
            builds,
            totals: Default::default(),
            gates: Vec::new(),
            cluster: None,
            utilization: Default::default(),
        };
        top.status = Some(status);
        top
    }

    #[test]
    fn idle_builds_get_no_row_and_busy_ones_sort_by_held() {
        let top = top_with(vec![
            build(1, "idle", 0, 0),
            build(2, "small", 1, 3),
            build(3, "big", 5, 9),
        ]);
        let names: Vec<_> = top.rows().iter().map(|b| b.name.clone()).collect();
        assert_eq!(names, ["big", "small"]);
    }

    #[test]
    fn the_selection_follows_its_build_and_stops_at_the_ends() {
        let mut top = top_with(vec![build(2, "small", 1, 3), build(3, "big", 5, 9)]);
        top.select(1);
        assert_eq!(top.selected, Some(3), "the first key selects the top row");
        top.select(1);
        top.select(1);
        assert_eq!(top.selected, Some(2));
        top.sort = Sort::Name;
        top.select(-1);
        assert_eq!(top.selected, Some(3), "big is above small by name");
    }

    #[test]
    fn a_small_terminal_still_draws() {
        let top = top_with(vec![build(2, "small", 1, 3)]);
        for (w, h) in [(20, 5), (1, 1), (120, 40)] {
            let mut terminal = Terminal::new(TestBackend::new(w, h)).unwrap();
            terminal.draw(|f| top.draw(f)).unwrap();
        }
    }

    /// The holders panel lists the selected build's holders, and only
    /// theirs: moving the selection moves the panel with it.
    #[test]
    fn the_holders_panel_shows_the_selected_build_s_holders_only() {
        let mut top = top_with(vec![build(2, "small", 1, 3), build(3, "big", 2, 9)]);
        let holder =
            |pid: u32, build: u64, tokens: u32, command: &str| baton_core::status::Holder {
                pid,
                command: command.into(),
                tokens,
                since: now(),
                transport: "socket".into(),
                build,
                stopped: false,
            };
        top.status.as_mut().unwrap().holders = vec![
            holder(42002, 2, 1, "make-small-job"),
            holder(43003, 3, 2, "make-big-job"),
        ];
        let shown = |top: &Top| {
            let mut terminal = Terminal::new(TestBackend::new(120, 40)).unwrap();
            terminal.draw(|f| top.draw(f)).unwrap();
            terminal.backend().to_string()
        };
        let screen = shown(&top);
        assert!(
            screen.contains("holders of big")
                && screen.contains("make-big-job")
                && screen.contains("43003")
                && !screen.contains("make-small-job")
                && !screen.contains("42002"),
            "the top row (big) is selected at first:\n{screen}"
        );
        top.select(1);
        top.select(1);
        let screen = shown(&top);
        assert!(
            screen.contains("holders of small")
                && screen.contains("make-small-job")
                && !screen.contains("make-big-job"),
            "small selected:\n{screen}"
        );
    }

    /// Sorted by RUNNING, the build that has run longest (started first)
    /// comes first; `r` reverses that.
    #[test]
    fn sorted_by_running_the_oldest_build_comes_first() {
        let started = |id: u64, name: &str, ago: f64| Build {
            since: now() - ago,
            ..build(id, name, 1, 1)
        };
        let mut top = top_with(vec![
            started(1, "middle", 60.0),
            started(2, "newest", 5.0),
            started(3, "oldest", 3600.0),
        ]);
        top.sort = Sort::Running;
        let names =
            |top: &Top| -> Vec<String> { top.rows().iter().map(|b| b.name.clone()).collect() };
        assert_eq!(names(&top), ["oldest", "middle", "newest"]);
        top.reversed = true;
        assert_eq!(names(&top), ["newest", "middle", "oldest"]);
    }

    /// Sorted by WAIT p99, the build whose slowest waits are longest comes
    /// first, whatever its median: here the p50 order is the reverse.
    #[test]
    fn sorted_by_wait_p99_the_longest_tail_comes_first() {
        let waits = |id: u64, name: &str, p50: f64, p99: f64| Build {
            wait_ms_p50: Some(p50),
            wait_ms_p99: Some(p99),
            ..build(id, name, 1, 1)
        };
        let mut top = top_with(vec![
            waits(1, "steady", 40.0, 50.0),
            waits(2, "spiky", 1.0, 900.0),
        ]);
        top.sort = Sort::WaitP99;
        let names: Vec<_> = top.rows().iter().map(|b| b.name.clone()).collect();
        assert_eq!(names, ["spiky", "steady"]);
    }

    fn headers(width: u16) -> Vec<&'static str> {
        columns_that_fit(width).iter().map(|c| c.header).collect()
    }

    /// A terminal too narrow for every column loses the least telling
    /// first (RUNNING, then WAIT p99: the highest drop ranks); JOBS and
    /// WAITING, which say whether a build is starved, stay longest.
    #[test]
    fn a_narrow_terminal_drops_the_least_telling_columns_first() {
        let all = headers(u16::MAX);
        assert_eq!(all.len(), COLUMNS.len());
        // Every column with the cell between: RUNNING and WAIT p99 (10
        // cells each) must go to fit in 20 fewer.
        let full: u16 = COLUMNS.iter().map(|c| c.width + 1).sum();
        assert_eq!(
            headers(full - 20),
            ["NAME", "WEIGHT", "HELD", "JOBS", "WAITING", "GRANTS", "WAIT p50"]
        );
        assert_eq!(headers(1), ["NAME", "HELD"], "those two always stay");
    }

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(
            [show_ms(0.0), show_ms(0.25), show_ms(12.4), show_ms(1500.0)],
            ["0", "250us", "12ms", "1.5s"]
        );
        assert_eq!(
            [
                show_seconds(4.25),
                show_seconds(187.0),
                show_seconds(7500.0)
            ],
            ["4.2s", "3m07s", "2h05m"]
        );
    }
}
