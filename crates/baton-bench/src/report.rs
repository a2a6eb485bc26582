//! Results: one row per measurement, shown as a table, a JSON document or
//! a chart against the number of waiters.

use crate::measure::Usage;
use crate::team::Outcome;
use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{Map, Value};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

/// One measurement of one mechanism at one scale.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub mechanism: String,
    pub waiters: usize,
    pub operations: u64,
    pub context_switches_per_op: f64,
    /// The part of them where a process blocked (the rest: preempted).
    pub voluntary_context_switches_per_op: f64,
    pub cpu_us_per_op: f64,
    pub wall_s: f64,
    pub ops_per_s: f64,
    /// The broker's share of the context switches (included above).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker_context_switches_per_op: Option<f64>,
    /// The part of the broker's where it blocked (the rest: it was preempted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker_voluntary_context_switches_per_op: Option<f64>,
    /// The broker's share of the CPU (included above).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker_cpu_us_per_op: Option<f64>,
    /// Scenario-specific figures and parameters.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Row {
    /// A row from a team's outcome; operations are what its members counted.
    pub fn of_team(mechanism: &str, waiters: usize, outcome: &Outcome, has_broker: bool) -> Row {
        Row::new(
            mechanism,
            waiters,
            outcome.ops(),
            outcome.usage,
            has_broker.then_some(outcome.broker),
            outcome.wall,
        )
    }

    /// `usage` is everything spent, the broker's share (if any) included.
    pub fn new(
        mechanism: &str,
        waiters: usize,
        ops: u64,
        usage: Usage,
        broker: Option<Usage>,
        wall: Duration,
    ) -> Row {
        let per_op = |x: u64| if ops == 0 { 0.0 } else { x as f64 / ops as f64 };
        let wall_s = wall.as_secs_f64();
        Row {
            mechanism: mechanism.to_string(),
            waiters,
            operations: ops,
            context_switches_per_op: per_op(usage.context_switches()),
            voluntary_context_switches_per_op: per_op(usage.voluntary_switches),
            cpu_us_per_op: per_op(usage.cpu_us),
            wall_s,
            ops_per_s: if wall_s > 0.0 {
                ops as f64 / wall_s
            } else {
                0.0
            },
            broker_context_switches_per_op: broker.map(|b| per_op(b.context_switches())),
            broker_voluntary_context_switches_per_op: broker.map(|b| per_op(b.voluntary_switches)),
            broker_cpu_us_per_op: broker.map(|b| per_op(b.cpu_us)),
            extra: Map::new(),
        }
    }

    /// Adds a scenario-specific column.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Row {
        self.extra.insert(key.to_string(), value.into());
        self
    }
}

/// The machine the figures came from.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub kernel: String,
    pub cpus: usize,
    pub cpu_model: String,
}

impl Machine {
    pub fn this() -> Machine {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
            .unwrap_or_default();
        Machine {
            kernel,
            cpus,
            cpu_model,
        }
    }
}

/// A whole run: what `--json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: String,
    pub machine: Machine,
    /// The scale the scenario ran at.
    pub parameters: Map<String, Value>,
    pub results: Vec<Row>,
    /// What the reader needs to read the figures right.
    pub notes: Vec<String>,
}

impl Report {
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("a report is plain data")
    }

    /// The readable table for stdout.
    pub fn table(&self) -> String {
        let extra_keys = self.extra_keys();
        let mut header = vec![
            "mechanism",
            "waiters",
            "ops",
            "csw/op",
            "voluntary",
            "CPU µs/op",
            "wall s",
            "ops/s",
            "broker csw/op",
            "broker voluntary",
            "broker CPU µs/op",
        ];
        header.extend(extra_keys.iter().map(String::as_str));
        let rows: Vec<Vec<String>> = self
            .results
            .iter()
            .map(|r| table_cells(r, &extra_keys))
            .collect();
        let mut out = format!(
            "{} on Linux {}, {} CPUs ({})\n\n",
            self.scenario, self.machine.kernel, self.machine.cpus, self.machine.cpu_model
        );
        out += &render_table(&header, &rows);
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        out
    }

    fn extra_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = Vec::new();
        for key in self.results.iter().flat_map(|r| r.extra.keys()) {
            if !keys.contains(key) {
                keys.push(key.clone());
            }
        }
        keys
    }

    /// Draws context switches and CPU per operation against the number of
    /// waiters, one line per mechanism, on log-log axes (the herd grows by
    /// orders of magnitude where directed wake-ups stay flat).
    /// Scenarios of real builds (rows with a `case`) get bars instead: see
    /// [`Report::plot_cases`].
    pub fn plot(&self, path: &Path) -> Result<()> {
        use plotters::prelude::*;
        let root = SVGBackend::new(path, (900, 900)).into_drawing_area();
        root.fill(&WHITE)?;
        let (top, bottom) = root.split_vertically(450);
        if self.results.iter().any(|r| r.extra.contains_key("case")) {
            self.plot_cases(&top, &bottom)?;
        } else {
            self.plot_panel(&top, "context switches per operation", |r| {
                r.context_switches_per_op
            })?;
            self.plot_panel(&bottom, "CPU µs per operation", |r| r.cpu_us_per_op)?;
        }
        root.present()
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    /// Real builds: on top, each tool alone under baton as ratios to its
    /// own -jN (jobs running at once, wall time; the mark at 1 is par);
    /// below, each build's share of the token-time in every case where
    /// builds ran together, marked at its fair share.
    fn plot_cases<DB: plotters::prelude::DrawingBackend>(
        &self,
        top: &Area<DB>,
        bottom: &Area<DB>,
    ) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let number = |r: &Row, key: &str| r.extra.get(key).and_then(Value::as_f64);
        let text = |r: &Row, key: &str| {
            r.extra
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let alone: Vec<Bars> = self
            .results
            .iter()
            .filter_map(|r| {
                Some(Bars {
                    group: text(r, "tool"),
                    values: vec![number(r, "running_ratio")?, number(r, "wall_ratio")?],
                    marks: vec![Some(1.0); 2],
                })
            })
            .collect();
        bar_panel(
            top,
            &format!("{}: each alone, baton run / own -jN", self.scenario),
            &["jobs running at once", "wall time"],
            &alone,
        )?;
        let mut tools: Vec<String> = Vec::new();
        let mut together: Vec<Bars> = Vec::new();
        for row in self.results.iter().filter(|r| number(r, "share").is_some()) {
            let (case, tool) = (text(row, "case"), text(row, "tool"));
            if !tools.contains(&tool) {
                tools.push(tool);
            }
            if together.last().is_none_or(|b| b.group != case) {
                together.push(Bars {
                    group: case,
                    values: Vec::new(),
                    marks: Vec::new(),
                });
            }
            let bars = together.last_mut().expect("pushed above");
            bars.values.push(number(row, "share").unwrap_or_default());
            bars.marks.push(number(row, "fair_share"));
        }
        let series: Vec<&str> = tools.iter().map(String::as_str).collect();
        bar_panel(
            bottom,
            "builds together: share of token-time (mark: fair share)",
            &series,
            &together,
        )
    }

    /// One figure against the waiter counts: a linear axis from 0, so that
    /// a mechanism at zero (no context switch per operation) keeps its
    /// line; each count measured is a labelled place on the x axis, evenly
    /// spaced; the legend beside the chart, off the data.
    fn plot_panel<DB: plotters::prelude::DrawingBackend>(
        &self,
        area: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
        what: &str,
        value: impl Fn(&Row) -> f64,
    ) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        use plotters::prelude::*;
        let mut counts: Vec<usize> = self.results.iter().map(|r| r.waiters).collect();
        counts.sort_unstable();
        counts.dedup();
        let place = |waiters: usize| counts.iter().position(|&n| n == waiters).unwrap_or(0);
        let top = self.results.iter().map(&value).fold(0.0, f64::max);
        let top = if top > 0.0 { top * 1.1 } else { 1.0 };
        let width = area.dim_in_pixel().0;
        let (plot_area, legend_area) = area.split_horizontally(width * 3 / 4);
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(format!("{}: {what}", self.scenario), ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(60)
            // A discrete range holds both ends: 0..k-1 is k places.
            .build_cartesian_2d(
                (0..counts.len().saturating_sub(1)).into_segmented(),
                0.0..top,
            )?;
        let x_label = |x: &SegmentValue<usize>| match x {
            SegmentValue::CenterOf(i) => counts.get(*i).map_or(String::new(), usize::to_string),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .x_desc("waiters (N)")
            .y_desc(what)
            .x_labels(counts.len())
            .x_label_formatter(&x_label)
            .draw()?;
        for (i, mechanism) in self.mechanisms().into_iter().enumerate() {
            let color = Palette99::pick(i).stroke_width(2);
            let points: Vec<(SegmentValue<usize>, f64)> = self
                .results
                .iter()
                .filter(|r| r.mechanism == mechanism)
                .map(|r| (SegmentValue::CenterOf(place(r.waiters)), value(r)))
                .collect();
            chart.draw_series(LineSeries::new(points.clone(), color))?;
            chart.draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )?;
            let y = 60 + 22 * i as i32;
            legend_area.draw(&PathElement::new([(5, y), (25, y)], color))?;
            legend_area.draw(&Text::new(
                mechanism,
                (30, y - 7),
                ("sans-serif", 13).into_font(),
            ))?;
        }
        Ok(())
    }

    fn mechanisms(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for row in &self.results {
            if !names.contains(&row.mechanism) {
                names.push(row.mechanism.clone());
            }
        }
        names
    }
}

type Area<DB> = plotters::prelude::DrawingArea<DB, plotters::coord::Shift>;

/// One group of bars: a value per series, each with a reference mark.
struct Bars {
    group: String,
    values: Vec<f64>,
    marks: Vec<Option<f64>>,
}

/// Groups of bars side by side on a linear axis from 0, one colour per
/// series, a black mark across each bar where it has one, and the group's
/// name under it.
fn bar_panel<DB: plotters::prelude::DrawingBackend>(
    area: &Area<DB>,
    caption: &str,
    series: &[&str],
    groups: &[Bars],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    let width = series.len() as f64 + 1.0;
    let high = groups
        .iter()
        .flat_map(|g| {
            g.values
                .iter()
                .copied()
                .chain(g.marks.iter().flatten().copied())
        })
        .fold(0.0f64, f64::max)
        .max(0.1)
        * 1.4; // the legend sits above the bars
    let below = high * 0.1; // room for the groups' names
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(15)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..width * groups.len().max(1) as f64, -below..high)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .disable_x_axis()
        .y_labels(8)
        .draw()?;
    let bar_x = |g: usize, i: usize| g as f64 * width + 0.5 + i as f64;
    for (i, name) in series.iter().enumerate() {
        let color = Palette99::pick(i).filled();
        let bars = groups.iter().enumerate().filter_map(|(g, group)| {
            group
                .values
                .get(i)
                .map(|&v| Rectangle::new([(bar_x(g, i), 0.0), (bar_x(g, i) + 0.9, v)], color))
        });
        chart
            .draw_series(bars)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], color));
    }
    let marks = groups.iter().enumerate().flat_map(|(g, group)| {
        group.marks.iter().enumerate().filter_map(move |(i, m)| {
            m.map(|m| {
                PathElement::new(
                    [(bar_x(g, i) - 0.05, m), (bar_x(g, i) + 0.95, m)],
                    BLACK.stroke_width(2),
                )
            })
        })
    });
    chart.draw_series(marks)?;
    let style = TextStyle::from(("sans-serif", 13)).pos(Pos::new(HPos::Center, VPos::Center));
    let names = groups.iter().enumerate().map(|(g, group)| {
        Text::new(
            group.group.clone(),
            ((g as f64 + 0.5) * width, -below / 2.0),
            style.clone(),
        )
    });
    chart.draw_series(names)?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    Ok(())
}

fn table_cells(row: &Row, extra_keys: &[String]) -> Vec<String> {
    let mut cells = vec![
        row.mechanism.clone(),
        row.waiters.to_string(),
        row.operations.to_string(),
        format!("{:.2}", row.context_switches_per_op),
        format!("{:.2}", row.voluntary_context_switches_per_op),
        format!("{:.1}", row.cpu_us_per_op),
        format!("{:.2}", row.wall_s),
        format!("{:.0}", row.ops_per_s),
        row.broker_context_switches_per_op
            .map_or("-".to_string(), |b| format!("{b:.2}")),
        row.broker_voluntary_context_switches_per_op
            .map_or("-".to_string(), |b| format!("{b:.2}")),
        row.broker_cpu_us_per_op
            .map_or("-".to_string(), |b| format!("{b:.1}")),
    ];
    cells.extend(
        extra_keys
            .iter()
            .map(|k| row.extra.get(k).map_or("-".to_string(), format_value)),
    );
    cells
}

fn format_value(value: &Value) -> String {
    match value {
        Value::Number(n) if n.is_f64() => format!("{:.2}", n.as_f64().unwrap_or_default()),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Left-aligned first column, right-aligned numbers.
fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let width = |col: usize| {
        rows.iter()
            .map(|r| r[col].chars().count())
            .chain([header[col].chars().count()])
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..header.len()).map(width).collect();
    let line = |cells: Vec<&str>| -> String {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let pad = widths[i] - cell.chars().count();
            if i == 0 {
                out += cell;
                out += &" ".repeat(pad);
            } else {
                out += "  ";
                out += &" ".repeat(pad);
                out += cell;
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    out += &line(
        widths
            .iter()
            .map(|&w| "-".repeat(w))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str)
            .collect(),
    );
    for row in rows {
        out += &line(row.iter().map(String::as_str).collect());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::Usage;

    fn row(mechanism: &str, waiters: usize, switches: u64) -> Row {
        let usage = Usage {
            voluntary_switches: switches,
            involuntary_switches: 0,
            cpu_us: 10,
        };
        Row::new(
            mechanism,
            waiters,
            10,
            usage,
            None,
            Duration::from_millis(1),
        )
    }

    /// A mechanism with no context switch at all keeps its points and its
    /// legend entry; each waiter count is a label of the x axis.
    #[test]
    fn the_plot_keeps_zero_values_and_labels_each_waiter_count() {
        let report = Report {
            scenario: "token-ring".to_string(),
            machine: Machine::this(),
            parameters: Map::new(),
            results: vec![
                row("futex", 16, 0),
                row("baton native", 16, 20),
                row("futex", 256, 0),
                row("baton native", 256, 21),
            ],
            notes: Vec::new(),
        };
        let path = std::env::temp_dir().join(format!("baton-plot-{}.svg", std::process::id()));
        report.plot(&path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let circles = svg.matches("<circle").count();
        assert_eq!(circles, 4 * 2, "every row in both panels, zeros included");
        // Text nodes as plotters writes them, with the spaces around removed.
        let squashed: String = svg.split_whitespace().collect();
        for label in [">futex<", ">batonnative<", ">16<", ">256<"] {
            assert!(squashed.contains(label), "{label} missing");
        }
    }

    /// Every per-operation figure is the kernel's count over the
    /// operations (switches of both kinds, CPU), the broker's share
    /// likewise, the rate is operations over the wall time, and a run of
    /// no operations shows 0s, not NaN.
    #[test]
    fn a_rows_figures_are_the_kernels_counts_per_operation() {
        let spent = Usage {
            voluntary_switches: 1_500,
            involuntary_switches: 500,
            cpu_us: 35_000,
        };
        let broker = Usage {
            voluntary_switches: 80,
            involuntary_switches: 20,
            cpu_us: 2_000,
        };
        let row = Row::new(
            "m",
            64,
            1_000,
            spent,
            Some(broker),
            Duration::from_millis(500),
        );
        assert_eq!(row.operations, 1_000);
        assert_eq!(row.context_switches_per_op, 2.0);
        assert_eq!(row.voluntary_context_switches_per_op, 1.5);
        assert_eq!(row.cpu_us_per_op, 35.0);
        assert_eq!((row.wall_s, row.ops_per_s), (0.5, 2_000.0));
        assert_eq!(row.broker_context_switches_per_op, Some(0.1));
        assert_eq!(row.broker_voluntary_context_switches_per_op, Some(0.08));
        assert_eq!(row.broker_cpu_us_per_op, Some(2.0));
        let none = Row::new("m", 64, 0, spent, None, Duration::ZERO);
        assert_eq!(
            (
                none.context_switches_per_op,
                none.cpu_us_per_op,
                none.ops_per_s
            ),
            (0.0, 0.0, 0.0)
        );
        assert_eq!(none.broker_cpu_us_per_op, None);
    }
}
