//! The `rdmakit-perf` binary as a user runs it.

use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_rdmakit-perf");

#[test]
fn default_suite_prints_one_json_line_per_test() {
    let out = Command::new(BIN).args(["suite", "--json"]).output().expect("run rdmakit-perf");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Its first line (stderr with --json, stdout in a table) says where every figure came
    // from: the soft NIC, software, and why (no device here) when that is the case.
    let banner = String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or_default().to_owned();
    assert!(banner.contains("on the soft NIC (software RDMA"), "{banner}");
    assert!(banner.contains("every result is from provider soft, device soft0"), "{banner}");
    if rdmakit_has_no_device() {
        assert!(banner.contains("no RDMA device here"), "{banner}");
    }
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 12);
    for l in &lines {
        assert_eq!(l["provider"], "soft");
        let measured = l.get("t_typical").or_else(|| l.get("bw_average_mb_per_sec")).and_then(|v| v.as_f64());
        assert!(measured.is_some_and(|v| v > 0.0), "{l}");
    }
    assert!(lines.iter().any(|l| l["test"] == "atomic-lat" && l["placement"] == "memic"));
    for t in ["pipe-lat", "put-lat", "pipe-bw"] {
        assert!(lines.iter().any(|l| l["test"] == t), "no {t} row");
    }
}

/// rdma-core sees no device here (`ibv_devices` lists none, or libibverbs is not usable).
fn rdmakit_has_no_device() -> bool {
    Command::new("ibv_devices").output().map_or(true, |o| {
        let listed = String::from_utf8_lossy(&o.stdout).lines().skip(2).any(|l| !l.trim().is_empty());
        !o.status.success() || !listed
    })
}

#[test]
fn client_and_server_in_two_processes() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut server = Command::new(BIN)
        .args(["write-bw", "--server", &addr, "-n", "200"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("server");
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new(BIN)
        .args(["write-bw", "--connect", &addr, "-n", "200", "-s", "4096", "--json"])
        .output()
        .expect("client");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(
        (v["test"].as_str(), v["bytes"].as_u64(), v["iterations"].as_u64()),
        (Some("write-bw"), Some(4096), Some(200))
    );
    assert!(v["bw_average_mb_per_sec"].as_f64().unwrap() > 0.0);
    // The server exits once the client disconnects.
    let status = server.wait().unwrap();
    assert!(status.success());
}

/// put-lat across two processes: each end writes its handle's descriptor into the other's
/// buffer; the client reports the ping-pong (and send-lat at the same size is its baseline).
#[test]
fn put_lat_client_and_server_in_two_processes() {
    use std::io::BufRead;
    // Both detections (the server takes the client's), each at two sizes.
    for (size, sentinel) in [("8", false), ("4096", false), ("8", true), ("4096", true)] {
        let mut server = Command::new(BIN)
            .args(["put-lat", "--server", "127.0.0.1:0"])
            .stderr(Stdio::piped())
            .spawn()
            .expect("server");
        // The address it listens on, once it does (its first line).
        let mut lines = std::io::BufReader::new(server.stderr.take().unwrap()).lines();
        let addr = lines
            .find_map(|l| {
                l.ok()?.strip_prefix("rdmakit-perf: serving on ")?.split_whitespace().next().map(String::from)
            })
            .expect("the server says where it listens");
        // Never let its stderr fill up; keep it for the failure message.
        let said = std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>().join("\n"));
        let mut args = vec!["put-lat", "--connect", &addr, "-n", "300", "-s", size, "--json"];
        if sentinel {
            args.push("--sentinel");
        }
        let out = Command::new(BIN).args(&args).output().expect("client");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(
            (v["test"].as_str(), v["bytes"].as_u64(), v["iterations"].as_u64()),
            (Some("put-lat"), size.parse().ok(), Some(300))
        );
        assert!(v["t_typical"].as_f64().unwrap() > 0.0, "{v}");
        // The server ends once the client disconnects, without an error.
        let status = server.wait().unwrap();
        let said = said.join().unwrap();
        assert!(
            status.success(),
            "put-lat server ({size} B, sentinel {sentinel}): {status}; it said:\n{said}"
        );
    }
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let out = Command::new(BIN).args(["write-bw", "-s", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--size"));
    for args in [&["put-lat", "-s", "6", "--sentinel"][..], &["write-bw", "--sentinel"]] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("--sentinel"), "{args:?}");
    }
    let out = Command::new(BIN).args(["put-lat", "-s", "4"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 8 bytes"));
    // Without --size, put-lat moves 8 bytes (perftest's latency default, 2, is too small).
    let out = Command::new(BIN).args(["put-lat", "-n", "20", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Values that used to panic or abort (found by review): each a clear error now.
    for (args, says) in [
        (&["transfer", "--bytes", "1M", "--timeout", "18446744073709551615"][..], "--timeout"),
        (&["datagen", "--once", "--listen", "127.0.0.1:0", "--rate", "1e-30"], "--rate"),
        (&["write-lat", "-n", "4000000000"], "-n"),
        (&["pipe-lat", "-n", "4000000000"], "-n"),
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(says) && !err.contains("panicked"), "{args:?}: {err}");
    }
    let out = Command::new(BIN).args(["read-lat", "--provider", "nope"]).output().unwrap();
    assert!(!out.status.success());
    let out = Command::new(BIN).args(["read-lat", "--connect", "127.0.0.1:1", "-n", "1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rdmakit-perf:"));
}

#[test]
fn contended_fetch_add_counts_exactly() {
    let out = Command::new(BIN)
        .args(["fadd-contended", "--procs", "1,3", "-n", "300", "--placement", "memic", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let runs: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(runs.len(), 2);
    for (r, procs) in runs.iter().zip([1u64, 3]) {
        assert_eq!(r["procs"].as_u64(), Some(procs));
        assert_eq!(r["counter"].as_u64(), Some(procs * 300), "{r}");
        assert!(r["per_proc_min_mops"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn limits_reports_every_comparison() {
    let out = Command::new(BIN).args(["limits", "--json", "--runs", "1"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 15);
    for r in &rows {
        assert!(
            r["rdmakit_mb_per_sec"].as_f64().unwrap() > 0.0 && r["limit_mb_per_sec"].as_f64().unwrap() > 0.0,
            "{r}"
        );
    }
    let count = |pat: &str| rows.iter().filter(|r| r["what"].as_str().unwrap().contains(pat)).count();
    assert_eq!(count("raw TCP"), 4);
    assert_eq!(count("same-host"), 5);
    assert_eq!(count("--use-event"), 4);
    assert_eq!(rows.iter().filter(|r| r["unit"] == "us").count(), 5, "five latency rows");
    assert_eq!(count("pipe rwrite"), 3);
}

#[test]
fn bystander_prints_both_phases_on_both_paths() {
    for same_host in [false, true] {
        let mut args = vec!["bystander", "--read-size", "1048576", "--window", "2", "--seconds", "0.3"];
        if same_host {
            args.push("--same-host");
        }
        let out = Command::new(BIN).args(&args).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(text.contains(if same_host { "same-host rings" } else { "TCP wire" }), "{text}");
        for phase in ["alone", "beside reads"] {
            let row = text
                .lines()
                .find(|l| l.starts_with(phase))
                .unwrap_or_else(|| panic!("no {phase} row: {text}"));
            let writes: u64 = row[phase.len()..].split_whitespace().next().unwrap().parse().unwrap();
            assert!(writes > 0, "{row}");
        }
        let rate = text.lines().find(|l| l.starts_with("beside/alone")).expect("the ratio line");
        let gbs: f64 = rate.split(": ").last().unwrap().trim_end_matches(" GB/s").parse().unwrap();
        assert!(gbs > 0.0, "the reads moved nothing: {rate}");
    }
}
