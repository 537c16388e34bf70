//! `rdmakit-perf plot`: latency and bandwidth against message size, as an SVG a person can
//! look at, with rdmakit's series beside its baseline's.
//!
//! The input is the CSV that `scripts/perftest-compare.sh` writes for its size sweep (and
//! that anyone can write by hand): one measurement per line, `series,kind,size,value`, where
//! `kind` is `bw` (MiB/s) or `lat` (µs), `size` is the message size in bytes, and `series`
//! names the tool (`perftest ib_write_bw`, `rdmakit write-bw`, ...). Lines starting with `#`
//! are comments. Each kind gets its own panel, sizes on a log₂ axis.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

/// What `plot` takes.
#[derive(clap::Args, Debug, Clone)]
pub struct PlotArgs {
    /// The CSV of measurements (`series,kind,size,value`).
    pub input: PathBuf,
    /// The SVG to write.
    #[arg(short, long, default_value = "target/rdmakit-perf.svg")]
    pub output: PathBuf,
    /// A title above the panels.
    #[arg(long, default_value = "rdmakit-perf")]
    pub title: String,
}

/// A line of the CSV that is not a measurement.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    /// A line that does not parse.
    #[error("{path}:{line}: {reason} (expected `series,kind,size,value`)")]
    Parse { path: PathBuf, line: usize, reason: String },
    /// Nothing to draw.
    #[error("{0}: no measurements")]
    Empty(PathBuf),
    /// The drawing backend failed.
    #[error("drawing {path}: {reason}")]
    Draw { path: PathBuf, reason: String },
}

/// The two panels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// Bandwidth, MiB/s.
    Bw,
    /// Latency, µs.
    Lat,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Bw => "bandwidth [MiB/s]",
            Kind::Lat => "latency [µs]",
        })
    }
}

/// Measurements by panel, then by series: (size, value) sorted by size.
pub type Series = BTreeMap<Kind, BTreeMap<String, Vec<(u64, f64)>>>;

/// Parses the CSV text (`path` names it in errors).
pub fn parse(path: &Path, text: &str) -> Result<Series, PlotError> {
    let mut out = Series::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |reason: String| PlotError::Parse { path: path.to_owned(), line: i + 1, reason };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let [series, kind, size, value] = fields[..] else {
            return Err(bad(format!("{} fields", fields.len())));
        };
        let kind = match kind {
            "bw" => Kind::Bw,
            "lat" => Kind::Lat,
            k => return Err(bad(format!("kind {k:?} is neither bw nor lat"))),
        };
        let size: u64 = size.parse().map_err(|_| bad(format!("size {size:?}")))?;
        let value: f64 = value.parse().map_err(|_| bad(format!("value {value:?}")))?;
        if size == 0 || !value.is_finite() || value <= 0.0 {
            return Err(bad(format!("size {size} and value {value} must be positive")));
        }
        if series.is_empty() {
            return Err(bad("an empty series name".into()));
        }
        out.entry(kind).or_default().entry(series.to_owned()).or_default().push((size, value));
    }
    for by_series in out.values_mut() {
        for points in by_series.values_mut() {
            points.sort_by_key(|&(s, _)| s);
        }
    }
    if out.is_empty() {
        return Err(PlotError::Empty(path.to_owned()));
    }
    Ok(out)
}

/// Reads the CSV and writes the SVG; returns the number of points drawn.
pub fn run(args: &PlotArgs) -> Result<usize, PlotError> {
    let text = std::fs::read_to_string(&args.input)
        .map_err(|source| PlotError::Read { path: args.input.clone(), source })?;
    let series = parse(&args.input, &text)?;
    draw(&series, &args.output, &args.title)
}

/// Draws one panel per kind, side by side.
pub fn draw(series: &Series, output: &Path, title: &str) -> Result<usize, PlotError> {
    let fail = |e: &dyn fmt::Display| PlotError::Draw { path: output.to_owned(), reason: e.to_string() };
    if let Some(dir) = output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| fail(&e))?;
    }
    let panels = series.len() as u32;
    let root = SVGBackend::new(output, (560 * panels, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(|e| fail(&e))?;
    let mut drawn = 0;
    for (area, (kind, by_series)) in root.split_evenly((1, series.len())).iter().zip(series) {
        let points = by_series.values().flatten();
        let (min_s, max_s) = points.clone().fold((u64::MAX, 1), |(lo, hi), &(s, _)| (lo.min(s), hi.max(s)));
        let max_v = points.fold(0f64, |m, &(_, v)| m.max(v));
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d((min_s..max_s.max(min_s + 1)).log_scale().base(2.0), 0f64..max_v * 1.1)
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("message size [bytes]")
            .y_desc(kind.to_string())
            .x_label_formatter(&|s| human_size(*s))
            .draw()
            .map_err(|e| fail(&e))?;
        for (i, (name, pts)) in by_series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(|e| fail(&e))?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| fail(&e))?;
            drawn += pts.len();
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| fail(&e))?;
    }
    root.present().map_err(|e| fail(&e))?;
    Ok(drawn)
}

/// 8, 512, 4K, 64K, 1M, ...
fn human_size(s: u64) -> String {
    match s {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{}M", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{}K", s >> 10),
        s => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CSV: &str = "# perftest vs rdmakit\n\
        perftest ib_write_bw,bw,8,10.5\nrdmakit write-bw,bw,8,11\n\
        perftest ib_write_bw,bw,65536,900\nrdmakit write-bw,bw,65536,880\n\
        perftest ib_write_lat,lat,65536,40\nperftest ib_write_lat,lat,8,19.2\nrdmakit write-lat,lat,8,20.1\n";

    #[test]
    fn parses_sorts_and_draws_every_point() {
        let path = Path::new("sweep.csv");
        let s = parse(path, CSV).expect("valid CSV");
        assert_eq!(s[&Kind::Lat]["perftest ib_write_lat"], vec![(8, 19.2), (65536, 40.0)]);
        assert_eq!(s[&Kind::Bw].len(), 2);
        let out = std::env::temp_dir().join(format!("rdmakit-plot-{}.svg", std::process::id()));
        assert_eq!(draw(&s, &out, "test").expect("drawn"), 7);
        let svg = std::fs::read_to_string(&out).expect("written");
        std::fs::remove_file(&out).ok();
        assert!(svg.starts_with("<svg") && svg.contains("rdmakit write-bw") && svg.contains("latency"));
        assert_eq!(svg.matches("<circle").count(), 7, "one marker per measurement");
    }

    #[test]
    fn bad_lines_are_errors_with_their_line_number() {
        let path = Path::new("x.csv");
        for (text, want) in [
            ("a,bw,8\n", "x.csv:1: 3 fields"),
            ("a,bw,8,1\na,speed,8,1\n", "x.csv:2: kind \"speed\""),
            ("a,lat,eight,1\n", "size \"eight\""),
            ("a,lat,8,-1\n", "must be positive"),
            (",lat,8,1\n", "empty series"),
        ] {
            let e = parse(path, text).expect_err(text).to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        assert!(matches!(parse(path, "# only a comment\n"), Err(PlotError::Empty(_))));
    }
}
