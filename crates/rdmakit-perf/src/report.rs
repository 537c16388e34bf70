//! Output in perftest's column layouts, or JSON lines.
//!
//! Latency: `#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%` (µs;
//! t_typical is the median); a timed latency run (`-D`): `#bytes #iterations t_avg tps
//! average`. Bandwidth: `#bytes #iterations BW peak BW average MsgRate`, in perftest's
//! MiB/sec (2^20 bytes) or, with `--report_gbits`, Gb/sec (10^9 bits), the message rate in
//! Mpps; a peak perftest does not measure (timed runs, more than 20000 iterations) prints
//! as 0.00. Tables are framed by perftest's dashed lines. `--output=bandwidth|message_rate|
//! latency` prints only that one figure per row, as perftest does.

use rdmakit_verbs::Context;
use serde::Serialize;

use crate::measure::{Bw, Measured};
use crate::rig::{Params, Placement, Test};

/// Latency statistics, microseconds.
#[derive(Serialize)]
pub(crate) struct Lat {
    pub(crate) t_min: f64,
    pub(crate) t_max: f64,
    pub(crate) t_typical: f64,
    pub(crate) t_avg: f64,
    pub(crate) t_stdev: f64,
    pub(crate) p99: f64,
    pub(crate) p99_9: f64,
}

/// The statistics of latency samples `v` (µs), percentiles as perftest takes them.
pub(crate) fn lat_stats(v: &[f64]) -> Lat {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len().max(1) as f64;
    let avg = s.iter().sum::<f64>() / n;
    let var = s.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / n;
    let pct = |q: f64| {
        s.get(((q * n).ceil() as usize).saturating_sub(1).min(s.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    Lat {
        t_min: s.first().copied().unwrap_or(0.0),
        t_max: s.last().copied().unwrap_or(0.0),
        t_typical: pct(0.5),
        t_avg: avg,
        t_stdev: var.sqrt(),
        p99: pct(0.99),
        p99_9: pct(0.999),
    }
}

/// A timed latency run's figures.
#[derive(Serialize)]
struct LatTimed {
    t_avg: f64,
    tps_average: f64,
}

#[derive(Serialize)]
struct BwOut {
    /// `null` where perftest does not measure a peak.
    bw_peak_mb_per_sec: Option<f64>,
    bw_average_mb_per_sec: f64,
    bw_peak_gbit_per_sec: Option<f64>,
    bw_average_gbit_per_sec: f64,
    msg_rate_mpps: f64,
    /// Operations per requested completion (perftest's `-Q`); `null` for pipe tests.
    cq_mod: Option<u32>,
}

/// perftest's MiB.
const MIB: f64 = (1u64 << 20) as f64;
/// perftest's Gb/sec in bytes per second: 10^9 bits.
const GBIT: f64 = 125_000_000.0;

#[derive(Serialize)]
struct Line<'a> {
    test: Test,
    provider: String,
    device: &'a str,
    placement: Placement,
    bytes: u32,
    iterations: u64,
    qps: u32,
    bidirectional: bool,
    duration_secs: u16,
    #[serde(flatten)]
    lat: Option<Lat>,
    #[serde(flatten)]
    lat_timed: Option<LatTimed>,
    #[serde(flatten)]
    bw: Option<BwOut>,
}

/// perftest's `--output`: only one figure per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum Level {
    /// The average bandwidth (bandwidth tests).
    Bandwidth,
    /// The message rate (bandwidth tests).
    MessageRate,
    /// The average latency (latency tests).
    Latency,
}

const DASHES: &str =
    "---------------------------------------------------------------------------------------";

pub struct Out {
    json: bool,
    gbits: bool,
    level: Option<Level>,
}

impl Out {
    pub fn new(json: bool) -> Out {
        Out { json, gbits: false, level: None }
    }

    /// perftest's `--report_gbits` and `--output`.
    pub fn with(json: bool, gbits: bool, level: Option<Level>) -> Out {
        Out { json, gbits, level }
    }

    fn table(&self) -> bool {
        !self.json && self.level.is_none()
    }

    pub fn header(&self, test: Test, timed: bool) {
        if !self.table() {
            return;
        }
        println!("{DASHES}");
        if test.is_latency() && timed {
            println!(" {:<13} {:<16} {:>12} {:>14}", "#bytes", "#iterations", "t_avg[usec]", "tps average");
        } else if test.is_latency() {
            println!(
                " {:<10} {:<13} {:>12} {:>12} {:>15} {:>12} {:>14} {:>22} {:>24}",
                "#bytes",
                "#iterations",
                "t_min[usec]",
                "t_max[usec]",
                "t_typical[usec]",
                "t_avg[usec]",
                "t_stdev[usec]",
                "99% percentile[usec]",
                "99.9% percentile[usec]"
            );
        } else {
            let u = if self.gbits { "Gb" } else { "MiB" };
            println!(
                " {:<10} {:<13} {:>18} {:>21} {:>14}",
                "#bytes",
                "#iterations",
                format!("BW peak[{u}/sec]"),
                format!("BW average[{u}/sec]"),
                "MsgRate[Mpps]"
            );
        }
    }

    pub fn footer(&self) {
        if self.table() {
            println!("{DASHES}");
        }
    }

    pub fn row(&self, ctx: &Context, p: &Params, m: &Measured) {
        let line = self.line(ctx, p, m);
        if self.json {
            println!("{}", serde_json::to_string(&line).expect("serialisable"));
            return;
        }
        let unit = if self.gbits { GBIT } else { MIB };
        match (self.level, m) {
            (Some(Level::Latency), _) => {
                let avg = line.lat.as_ref().map(|l| l.t_avg).or(line.lat_timed.as_ref().map(|l| l.t_avg));
                println!("{:.6}", avg.unwrap_or(0.0));
                return;
            }
            (Some(Level::Bandwidth), Measured::Bandwidth(b)) => {
                println!("{:.6}", b.bytes_per_sec / unit);
                return;
            }
            (Some(Level::MessageRate), Measured::Bandwidth(b)) => {
                println!("{:.6}", b.msgs_per_sec / 1e6);
                return;
            }
            _ => {}
        }
        match m {
            Measured::Latency(_) => {
                let l = line.lat.as_ref().expect("latency");
                println!(
                    " {:<10} {:<13} {:>12.2} {:>12.2} {:>15.2} {:>12.2} {:>14.2} {:>22.2} {:>24.2}",
                    p.size,
                    line.iterations,
                    l.t_min,
                    l.t_max,
                    l.t_typical,
                    l.t_avg,
                    l.t_stdev,
                    l.p99,
                    l.p99_9
                );
            }
            Measured::LatencyTimed { iters, avg_us, per_sec } => {
                println!(" {:<13} {:<16} {:>12.2} {:>14.2}", p.size, iters, avg_us, per_sec);
            }
            Measured::Bandwidth(b) => {
                // perftest prints more decimals when a Gb/sec figure is below 0.1.
                let d = if self.gbits && b.bytes_per_sec / unit < 0.1 { 6 } else { 2 };
                println!(
                    " {:<10} {:<13} {:>18.d$} {:>21.d$} {:>14.6}",
                    p.size,
                    b.iters,
                    b.peak_bytes_per_sec.unwrap_or(0.0) / unit,
                    b.bytes_per_sec / unit,
                    b.msgs_per_sec / 1e6
                );
            }
        }
    }

    fn line<'a>(&self, ctx: &'a Context, p: &Params, m: &Measured) -> Line<'a> {
        let (lat, lat_timed, bw, iterations) = match m {
            Measured::Latency(v) => (Some(lat_stats(v)), None, None, v.len() as u64),
            Measured::LatencyTimed { iters, avg_us, per_sec } => {
                (None, Some(LatTimed { t_avg: *avg_us, tps_average: *per_sec }), None, *iters)
            }
            Measured::Bandwidth(b) => (None, None, Some(bw_out(b)), b.iters),
        };
        Line {
            test: p.test,
            provider: ctx.provider().to_string(),
            device: ctx.name(),
            placement: p.placement,
            bytes: p.size,
            iterations,
            qps: p.qps,
            bidirectional: p.bidir,
            duration_secs: p.duration,
            lat,
            lat_timed,
            bw,
        }
    }

    pub fn suite_header(&self) {
        if !self.json {
            println!(
                " {:<11} {:<9} {:>9} {:>11} {:>11} {:>11} {:>11} {:>14} {:>11}",
                "test",
                "placement",
                "#bytes",
                "#iters",
                "t_typ[us]",
                "t_avg[us]",
                "99%[us]",
                "BW avg[MiB/s]",
                "Mpps"
            );
        }
    }

    pub fn suite_row(&self, ctx: &Context, p: &Params, m: &Measured) {
        let line = self.line(ctx, p, m);
        if self.json {
            println!("{}", serde_json::to_string(&line).expect("serialisable"));
            return;
        }
        let placement = match p.placement {
            Placement::Host => "host",
            Placement::Memic => "memic",
        };
        match (&line.lat, &line.bw) {
            (Some(l), _) => println!(
                " {:<11} {:<9} {:>9} {:>11} {:>11.3} {:>11.3} {:>11.3} {:>14} {:>11}",
                p.test.name(),
                placement,
                p.size,
                p.iters,
                l.t_typical,
                l.t_avg,
                l.p99,
                "-",
                "-"
            ),
            (None, Some(b)) => println!(
                " {:<11} {:<9} {:>9} {:>11} {:>11} {:>11} {:>11} {:>14.1} {:>11.3}",
                p.test.name(),
                placement,
                p.size,
                p.iters,
                "-",
                "-",
                "-",
                b.bw_average_mb_per_sec,
                b.msg_rate_mpps
            ),
            _ => {}
        }
    }
}

fn bw_out(b: &Bw) -> BwOut {
    BwOut {
        bw_peak_mb_per_sec: b.peak_bytes_per_sec.map(|v| v / MIB),
        bw_average_mb_per_sec: b.bytes_per_sec / MIB,
        bw_peak_gbit_per_sec: b.peak_bytes_per_sec.map(|v| v / GBIT),
        bw_average_gbit_per_sec: b.bytes_per_sec / GBIT,
        msg_rate_mpps: b.msgs_per_sec / 1e6,
        cq_mod: (b.cq_mod > 0).then_some(b.cq_mod),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_moments() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        let s = lat_stats(&v);
        assert_eq!((s.t_min, s.t_max, s.t_typical, s.p99, s.p99_9), (1.0, 1000.0, 500.0, 990.0, 999.0));
        assert!((s.t_avg - 500.5).abs() < 1e-9);
        assert!((s.t_stdev - 288.675).abs() < 1e-3);
    }

    #[test]
    fn a_sweeps_sizes_keep_cq_moderation_as_perftests_run_all() {
        // perftest turns its default moderation off above 8 KiB in a run of one size, not in
        // an -a sweep; a size of a sweep (Params::at) must still know it is one.
        let one = Params::simple(Test::WriteBw, 65536, 50, 128, Placement::Host);
        assert_eq!(one.cq_mod_at(65536, false), 1);
        let at = Params { all: true, ..one }.at(65536);
        assert!(at.in_sweep && !at.all && at.sizes() == [65536]);
        assert_eq!(at.cq_mod_at(65536, false), 100);
        assert_eq!(at.cq_mod_at(4096, false), 100);
    }

    #[test]
    fn params_round_trip_and_reject_garbage() {
        let p = Params {
            qps: 3,
            bidir: true,
            duration: 9,
            margin: 2,
            inline: 236,
            rx_depth: 77,
            cq_mod: 33,
            ..Params::simple(Test::SendBw, 4096, 7, 3, Placement::Memic)
        };
        let q = Params::decode(&p.encode()).unwrap();
        assert_eq!((q.test, q.size, q.iters, q.window, q.placement), (p.test, 4096, 7, 3, Placement::Memic));
        assert_eq!(
            (q.qps, q.bidir, q.all, q.duration, q.margin, q.inline, q.rx_depth, q.cq_mod),
            (3, true, false, 9, 2, 236, 77, 33)
        );
        assert!(Params::decode(&[0; 5]).is_err());
        assert!(Params::decode(&[99; Params::ENCODED_LEN]).is_err());
        // A hostile client's sizes and depths are refused, not allocated.
        let mut b = p.encode();
        b[2..6].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Params::decode(&b).unwrap_err().contains("size"));
        let mut b = p.encode();
        b[18] = 0;
        assert!(Params::decode(&b).unwrap_err().contains("QPs"));
        let mut b = p.encode();
        b[19] = 0xff;
        assert!(Params::decode(&b).unwrap_err().contains("flags"));
    }
}
