//! Output in perftest's column layouts, or JSON lines.
//!
//! Latency: `#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%` (µs;
//! t_typical is the median). Bandwidth: `#bytes #iterations BW peak BW average MsgRate`,
//! with perftest's "MB" meaning 2^20 bytes and the message rate in Mpps.

use rdmakit_verbs::Context;
use serde::Serialize;

use crate::measure::Measured;
use crate::rig::{Params, Placement, Test};

/// Latency statistics, microseconds.
#[derive(Serialize)]
struct Lat {
    t_min: f64,
    t_max: f64,
    t_typical: f64,
    t_avg: f64,
    t_stdev: f64,
    p99: f64,
    p99_9: f64,
}

fn lat_stats(v: &[f64]) -> Lat {
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

#[derive(Serialize)]
struct Bw {
    bw_peak_mb_per_sec: f64,
    bw_average_mb_per_sec: f64,
    msg_rate_mpps: f64,
}

const MB: f64 = (1u64 << 20) as f64;

#[derive(Serialize)]
struct Line<'a> {
    test: Test,
    provider: String,
    device: &'a str,
    placement: Placement,
    bytes: u32,
    iterations: u32,
    #[serde(flatten)]
    lat: Option<Lat>,
    #[serde(flatten)]
    bw: Option<Bw>,
}

pub struct Out {
    json: bool,
}

impl Out {
    pub fn new(json: bool) -> Out {
        Out { json }
    }

    pub fn header(&self, test: Test) {
        if self.json {
            return;
        }
        if test.is_latency() {
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
            println!(
                " {:<10} {:<13} {:>16} {:>19} {:>14}",
                "#bytes", "#iterations", "BW peak[MB/sec]", "BW average[MB/sec]", "MsgRate[Mpps]"
            );
        }
    }

    pub fn row(&self, ctx: &Context, p: &Params, m: &Measured) {
        let line = self.line(ctx, p, m);
        if self.json {
            println!("{}", serde_json::to_string(&line).expect("serialisable"));
            return;
        }
        match (&line.lat, &line.bw) {
            (Some(l), _) => println!(
                " {:<10} {:<13} {:>12.2} {:>12.2} {:>15.2} {:>12.2} {:>14.2} {:>22.2} {:>24.2}",
                p.size, p.iters, l.t_min, l.t_max, l.t_typical, l.t_avg, l.t_stdev, l.p99, l.p99_9
            ),
            (None, Some(b)) => println!(
                " {:<10} {:<13} {:>16.2} {:>19.2} {:>14.6}",
                p.size, p.iters, b.bw_peak_mb_per_sec, b.bw_average_mb_per_sec, b.msg_rate_mpps
            ),
            (None, None) => {}
        }
    }

    fn line<'a>(&self, ctx: &'a Context, p: &Params, m: &Measured) -> Line<'a> {
        let (lat, bw) = match m {
            Measured::Latency(v) => (Some(lat_stats(v)), None),
            Measured::Bandwidth { bytes, secs, peak_bytes_per_sec } => {
                let avg = *bytes as f64 / secs.max(1e-9);
                let rate = f64::from(p.iters) / secs.max(1e-9) / 1e6;
                (
                    None,
                    Some(Bw {
                        bw_peak_mb_per_sec: peak_bytes_per_sec / MB,
                        bw_average_mb_per_sec: avg / MB,
                        msg_rate_mpps: rate,
                    }),
                )
            }
        };
        Line {
            test: p.test,
            provider: ctx.provider().to_string(),
            device: ctx.name(),
            placement: p.placement,
            bytes: p.size,
            iterations: p.iters,
            lat,
            bw,
        }
    }

    pub fn suite_header(&self) {
        if !self.json {
            println!(
                " {:<11} {:<9} {:>9} {:>11} {:>11} {:>11} {:>11} {:>13} {:>11}",
                "test",
                "placement",
                "#bytes",
                "#iters",
                "t_typ[us]",
                "t_avg[us]",
                "99%[us]",
                "BW avg[MB/s]",
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
                " {:<11} {:<9} {:>9} {:>11} {:>11.3} {:>11.3} {:>11.3} {:>13} {:>11}",
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
                " {:<11} {:<9} {:>9} {:>11} {:>11} {:>11} {:>11} {:>13.1} {:>11.3}",
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
            (None, None) => {}
        }
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
    fn params_round_trip_and_reject_garbage() {
        let p = Params { test: Test::SendBw, size: 4096, iters: 7, window: 3, placement: Placement::Memic };
        let q = Params::decode(&p.encode()).unwrap();
        assert_eq!((q.test, q.size, q.iters, q.window, q.placement), (p.test, 4096, 7, 3, Placement::Memic));
        assert!(Params::decode(&[0; 5]).is_err());
        assert!(Params::decode(&[99; 14]).is_err());
    }
}
