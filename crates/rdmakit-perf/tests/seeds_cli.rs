//! `rpipe-seed` and `ckdirect-seed` as a user runs them, with tiny iteration counts: every
//! expected row is printed, with finite figures (latencies positive).

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_rdmakit-perf");

/// The measured rows (those ending in the provider label): the first cell (a size, "8 B")
/// and the numbers after it (a trailing `%` stripped).
fn rows(out: &str) -> Vec<(String, Vec<f64>)> {
    out.lines()
        .filter(|l| l.trim_end().ends_with(" soft"))
        .map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            let nums = t[2..t.len() - 1]
                .iter()
                .map(|x| {
                    x.trim_end_matches('%').parse::<f64>().unwrap_or_else(|_| panic!("not a number in {l:?}"))
                })
                .collect();
            (format!("{} {}", t[0], t[1]), nums)
        })
        .collect()
}

fn run(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().expect("run rdmakit-perf");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn rpipe_seed_prints_its_three_tables() {
    let out = run(&["rpipe-seed", "-n", "20", "--runs", "1", "--max-size", "4096"]);
    let rows = rows(&out);
    let sizes = ["8 B", "64 B", "512 B", "4 KiB"];
    // rwrite PUT_W_SYNC | 2PUT | ratio | raw | ratio, rread, per-policy (4 latencies, 3 ratios).
    for (cols, what) in [(5, "rwrite modes"), (1, "rread"), (7, "policies")] {
        let t: Vec<_> = rows.iter().filter(|(_, n)| n.len() == cols).collect();
        assert_eq!(t.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(), sizes, "{what}:\n{out}");
        for (s, n) in t {
            assert!(n.iter().all(|v| v.is_finite() && *v > 0.0), "{what} {s}: {n:?}\n{out}");
        }
    }
    assert!(out.contains("seed (small/medium rwrite 0.65 us"), "{out}");
    assert!(out.contains("seed (small/medium rread 2.14 us)"), "{out}");
    assert!(out.contains("Cray XC30"), "{out}");
}

#[test]
fn ckdirect_seed_prints_ping_pong_and_jacobi() {
    let out = run(&[
        "ckdirect-seed",
        "-n",
        "20",
        "--runs",
        "1",
        "--max-size",
        "4096",
        "--faces",
        "64,1024",
        "--ranks",
        "3",
        "--rows",
        "4",
        "--jacobi-iters",
        "5",
    ]);
    let rows = rows(&out);
    // put | put (sentinel) | send/recv | improvement % | sentinel improvement %.
    let ping: Vec<_> = rows.iter().filter(|(_, n)| n.len() == 5).collect();
    assert_eq!(ping.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(), ["8 B", "1 KiB", "4 KiB"], "{out}");
    // iteration: put | sentinel | send/recv | put % | sentinel %, and the same for the
    // exchange alone.
    let jacobi: Vec<_> = rows.iter().filter(|(_, n)| n.len() == 10).collect();
    assert_eq!(jacobi.iter().map(|(s, _)| s.as_str()).collect::<Vec<_>>(), ["64 B", "1 KiB"], "{out}");
    for (s, n) in &ping {
        assert!(n.iter().all(|v| v.is_finite()), "{s}: {n:?}\n{out}");
        assert!(n[..3].iter().all(|&v| v > 0.0) && n[3..].iter().all(|&p| p < 100.0), "{s}: {n:?}\n{out}");
    }
    for (s, n) in &jacobi {
        assert!(n.iter().all(|v| v.is_finite()), "{s}: {n:?}\n{out}");
        // The times are positive; an improvement is below 100 % (it may be negative).
        let (times, pcts): (Vec<_>, Vec<_>) = n.iter().enumerate().partition(|(i, _)| i % 5 < 3);
        assert!(times.iter().all(|&(_, &v)| v > 0.0), "{s}: {n:?}\n{out}");
        assert!(pcts.iter().all(|&(_, &p)| p < 100.0), "{s}: {n:?}\n{out}");
    }
    assert!(out.contains("Abe"), "{out}");
}

#[test]
fn seed_benchmarks_refuse_bad_options() {
    for args in [
        &["rpipe-seed", "--max-size", "4"][..],
        &["ckdirect-seed", "--max-size", "4"],
        &["ckdirect-seed", "--ranks", "1", "--max-size", "8", "-n", "5"],
        &["ckdirect-seed", "--faces", "4", "--max-size", "8", "-n", "5"],
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(String::from_utf8_lossy(&out.stderr).contains("rdmakit-perf:"), "{args:?}");
    }
}
