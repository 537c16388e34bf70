//! perftest's flags on `rdmakit-perf`, run as a user runs them: `-a` sweeps, `-D` timed
//! runs, `--report_gbits` units, `-b`, `-q`, `-t`/`-r`/`-I`/`-F`, `--output`, `send-lat`,
//! and `--provider verbs` on a host without an RDMA device.

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_rdmakit-perf");

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run rdmakit-perf")
}

fn ok(args: &[&str]) -> String {
    let out = run(args);
    assert!(out.status.success(), "{args:?}: exit {}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout.lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect()
}

/// The rows of a perftest-style table: the lines between the dashed frame and below the
/// header, split into fields.
fn table_rows(stdout: &str) -> (String, Vec<Vec<String>>) {
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines.first().is_some_and(|l| l.starts_with("-----")), "no top frame:\n{stdout}");
    assert!(lines.last().is_some_and(|l| l.starts_with("-----")), "no bottom frame:\n{stdout}");
    let header = lines[1].to_owned();
    let rows =
        lines[2..lines.len() - 1].iter().map(|l| l.split_whitespace().map(str::to_owned).collect()).collect();
    (header, rows)
}

fn sweep() -> Vec<u64> {
    (1..24).map(|i| 1u64 << i).collect()
}

#[test]
fn all_sizes_sweep_has_one_row_per_power_of_two_from_2_to_8_mib() {
    // A bandwidth sweep, in perftest's text layout.
    let (header, rows) = table_rows(&ok(&["send-bw", "-a", "-n", "5"]));
    assert!(header.contains("BW peak[MiB/sec]") && header.contains("MsgRate[Mpps]"), "{header}");
    let sizes: Vec<u64> = rows.iter().map(|r| r[0].parse().unwrap()).collect();
    assert_eq!(sizes, sweep());
    for r in &rows {
        assert_eq!(r[1], "5", "{r:?}");
        // The message rate (2-byte messages may print 0.00 MiB/sec, as in perftest).
        assert!(r[4].parse::<f64>().unwrap() > 0.0, "{r:?}");
    }
    // A latency sweep, as JSON.
    let lines = json_lines(&ok(&["write-lat", "-a", "-n", "5", "--json"]));
    let sizes: Vec<u64> = lines.iter().map(|l| l["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, sweep());
    assert!(lines.iter().all(|l| l["t_typical"].as_f64().is_some_and(|t| t > 0.0)));
    // perftest refuses -a for atomics (always 8 bytes).
    let out = run(&["atomic-bw", "-a"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("8 bytes"));
}

#[test]
fn report_gbits_uses_perftests_units() {
    let l = &json_lines(&ok(&["write-bw", "-n", "200", "-s", "65536", "--json"]))[0];
    let mib = l["bw_average_mb_per_sec"].as_f64().unwrap();
    let gbit = l["bw_average_gbit_per_sec"].as_f64().unwrap();
    assert!(mib > 0.0);
    // perftest: Gb = 10^9 bits, MiB = 2^20 bytes, so MiB/s = Gb/s x 10^9 / (2^20 x 8).
    let factor = 1e9 / (1048576.0 * 8.0);
    assert!((mib / gbit - factor).abs() < 1e-9 * factor, "{mib} MiB/s vs {gbit} Gb/s");
    let (header, rows) = table_rows(&ok(&["write-bw", "-n", "200", "--report_gbits"]));
    assert!(header.contains("BW peak[Gb/sec]") && header.contains("BW average[Gb/sec]"), "{header}");
    assert_eq!(rows.len(), 1);
    // With --output only the figure is printed, in the same units.
    let out = ok(&["write-bw", "-n", "200", "--report_gbits", "--output=bandwidth"]);
    assert_eq!(out.lines().count(), 1, "{out}");
    assert!(out.trim().parse::<f64>().unwrap() > 0.0);
}

#[test]
fn output_prints_only_the_figure_asked_for() {
    let lat = ok(&["read-lat", "-n", "50", "--output=latency"]);
    assert_eq!(lat.lines().count(), 1, "{lat}");
    assert!(lat.trim().parse::<f64>().unwrap() > 0.0);
    let rate = ok(&["atomic-bw", "-n", "100", "--output", "message_rate"]);
    assert!(rate.trim().parse::<f64>().unwrap() > 0.0);
    // perftest's rule: latency for latency tests, bandwidth or message_rate for the others.
    for args in [&["read-lat", "--output=bandwidth"][..], &["write-bw", "--output=latency"]] {
        let out = run(args);
        assert!(!out.status.success(), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--output"), "{args:?}");
    }
}

#[test]
fn timed_runs_use_perftests_duration_layout() {
    let (header, rows) = table_rows(&ok(&["read-lat", "-D", "3", "-f", "1"]));
    assert!(header.contains("t_avg[usec]") && header.contains("tps average"), "{header}");
    assert_eq!(rows.len(), 1);
    let (iters, avg, tps): (u64, f64, f64) =
        (rows[0][1].parse().unwrap(), rows[0][2].parse().unwrap(), rows[0][3].parse().unwrap());
    assert!(iters > 0 && avg > 0.0 && tps > 0.0, "{rows:?}");
    // Bandwidth: no peak in a timed run (null in JSON, as perftest prints 0.00).
    let l = &json_lines(&ok(&["write-bw", "-D", "3", "-f", "1", "--json"]))[0];
    assert_eq!(l["duration_secs"].as_u64(), Some(3));
    assert!(l["bw_peak_mb_per_sec"].is_null(), "{l}");
    assert!(l["iterations"].as_u64().unwrap() > 0 && l["bw_average_mb_per_sec"].as_f64().unwrap() > 0.0);
    // perftest's rules: the margins must leave something to measure; no -D with -a or -e.
    for args in [
        &["read-lat", "-D", "2", "-f", "1"][..],
        &["write-bw", "-D", "3", "-a"],
        &["write-bw", "-D", "5", "-e"],
    ] {
        let out = run(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"), "{args:?}");
    }
}

#[test]
fn bidirectional_and_several_qps_add_up() {
    let l = &json_lines(&ok(&["write-bw", "-b", "-q", "2", "-n", "100", "-s", "4096", "--json"]))[0];
    assert_eq!((l["qps"].as_u64(), l["bidirectional"].as_bool()), (Some(2), Some(true)));
    assert_eq!(l["iterations"].as_u64(), Some(100), "iterations are per QP, as perftest");
    assert!(l["bw_average_mb_per_sec"].as_f64().unwrap() > 0.0);
    let l = &json_lines(&ok(&["send-bw", "-b", "-n", "100", "-s", "4096", "--json"]))[0];
    assert!(l["msg_rate_mpps"].as_f64().unwrap() > 0.0);
    // -b and -q are for bandwidth tests.
    let out = run(&["write-lat", "-b"]);
    assert!(!out.status.success());
}

#[test]
fn queue_depth_inline_and_cpu_freq_flags_are_taken() {
    ok(&["write-lat", "-F", "-I", "0", "-n", "20"]);
    ok(&["send-lat", "-F", "-I", "64", "-s", "64", "-n", "20"]);
    ok(&["send-bw", "-F", "-t", "8", "-r", "16", "-n", "100", "-e"]);
    ok(&["write-bw", "--tx-depth", "4", "--inline_size", "64", "-s", "64", "-n", "100"]);
    // The soft NIC's inline limit is 256 bytes: more is a clear error, not a silent change.
    let out = run(&["write-lat", "-I", "4096", "-n", "5"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("inline"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Starts a server on a port the system picks and returns once it listens, with the address
/// it printed. (Picking a free port first and sleeping a while raced: on a loaded machine
/// the client could connect before the server listened, or another process take the port.)
fn server(args: &[&str]) -> (Child, String) {
    use std::io::BufRead;
    let mut child = Command::new(BIN)
        .args(args)
        .args(["--server", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("server");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    // Reads the server's stderr to the end, so that it never blocks on a full pipe; the
    // address goes back as soon as the listening line appears.
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("rdmakit-perf: serving on ") {
                let addr = rest.split_whitespace().next().unwrap_or_default().to_owned();
                if let Some(tx) = tx.take() {
                    let _ = tx.send(addr);
                }
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(addr) => (child, addr),
        Err(e) => {
            let _ = child.kill();
            panic!("the server did not say where it listens within 60 s ({e})");
        }
    }
}

#[test]
fn send_lat_and_sweeps_across_processes() {
    // send-lat: a ping-pong of sends, as ib_send_lat.
    let (mut srv, addr) = server(&["send-lat"]);
    let l = &json_lines(&ok(&["send-lat", "--connect", &addr, "-n", "50", "--json"]))[0];
    assert_eq!(
        (l["test"].as_str(), l["bytes"].as_u64(), l["iterations"].as_u64()),
        (Some("send-lat"), Some(2), Some(50))
    );
    assert!(l["t_typical"].as_f64().unwrap() > 0.0);
    assert!(srv.wait().unwrap().success());
    // A write-lat sweep: the server follows the client's sizes from the parameters it sent.
    let (mut srv, addr) = server(&["write-lat"]);
    let lines = json_lines(&ok(&["write-lat", "--connect", &addr, "-a", "-n", "5", "--json"]));
    assert_eq!(lines.iter().map(|l| l["bytes"].as_u64().unwrap()).collect::<Vec<_>>(), sweep());
    assert!(srv.wait().unwrap().success());
    // Several QPs, both directions: the server serves every QP and reports its direction.
    let (mut srv, addr) = server(&["send-bw"]);
    let l = &json_lines(&ok(&[
        "send-bw",
        "--connect",
        &addr,
        "-b",
        "-q",
        "2",
        "-n",
        "50",
        "-s",
        "4096",
        "--json",
    ]))[0];
    assert_eq!((l["qps"].as_u64(), l["bidirectional"].as_bool()), (Some(2), Some(true)));
    assert!(l["bw_average_mb_per_sec"].as_f64().unwrap() > 0.0);
    assert!(srv.wait().unwrap().success());
}

/// CQ moderation (`-Q`) as perftest's: a completion every 100 operations by default, every
/// one for messages over 8 KiB in a polling run of one size, never more than the send queue
/// depth; and the completions that are asked for retire every operation (the run ends, and
/// counts what it posted) whatever the count, timed or not, in one process or two.
#[test]
fn cq_moderation_follows_perftest_and_counts_every_operation() {
    let one = |args: &[&str]| json_lines(&ok(args)).remove(0);
    let cq_mod = |l: &serde_json::Value| l["cq_mod"].as_u64();
    // 1237 operations: the last ones are not a whole batch of 100.
    for test in ["write-bw", "read-bw", "send-bw", "atomic-bw"] {
        let l = one(&[test, "-s", "8", "-n", "1237", "--json"]);
        assert_eq!((cq_mod(&l), l["iterations"].as_u64()), (Some(100), Some(1237)), "{test}: {l}");
    }
    assert_eq!(cq_mod(&one(&["write-bw", "-s", "65536", "-n", "50", "--json"])), Some(1));
    assert_eq!(cq_mod(&one(&["write-bw", "-s", "65536", "-n", "50", "-e", "--json"])), Some(50));
    assert_eq!(cq_mod(&one(&["write-bw", "-s", "65536", "-n", "500", "-e", "--json"])), Some(100));
    assert_eq!(cq_mod(&one(&["write-bw", "-s", "8", "-n", "1000", "-t", "16", "--json"])), Some(16));
    assert_eq!(cq_mod(&one(&["write-bw", "-s", "65536", "-n", "301", "-Q", "7", "--json"])), Some(7));
    // A timed run stops between two asked-for completions and still drains.
    let l = one(&["write-bw", "-s", "8", "-D", "3", "-f", "1", "-Q", "97", "--json"]);
    assert!(l["iterations"].as_u64().unwrap() > 0, "{l}");
    // Across processes, both directions, with the peer counting its own.
    let (mut srv, addr) = server(&["write-bw"]);
    let l = one(&["write-bw", "--connect", &addr, "-b", "-s", "64", "-n", "1001", "-Q", "10", "--json"]);
    assert_eq!((cq_mod(&l), l["iterations"].as_u64()), (Some(10), Some(1001)), "{l}");
    assert!(srv.wait().unwrap().success());
    let out = run(&["write-bw", "-Q", "0"]);
    assert!(!out.status.success(), "-Q 0 must be refused");
}

/// `--provider verbs` never falls back to the soft NIC: on a host without a device it fails
/// and says why; on a host with one it measures the device.
#[test]
fn verbs_provider_without_a_device_fails_clearly() {
    for args in [&["write-lat", "--provider", "verbs", "-n", "5"][..], &["--provider", "verbs", "--json"]] {
        let out = run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            // A real device: every result names it.
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(!stdout.contains("\"provider\":\"soft\""), "{args:?} fell back to soft: {stdout}");
        } else {
            assert!(err.contains("--provider verbs"), "{args:?}: {err}");
            assert!(err.contains("does not fall back to the soft NIC"), "{args:?}: {err}");
            assert!(!err.contains("panicked"), "{args:?}: {err}");
            assert!(
                out.stdout.is_empty(),
                "{args:?} printed results: {}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }
    // The suite takes --provider/--device/--gid-index without a subcommand.
    let out = run(&["--provider", "nope"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--provider nope"));
}
