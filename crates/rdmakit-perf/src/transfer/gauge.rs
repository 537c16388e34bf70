//! Live throughput gauges: a progress bar in the terminal, and `--gauge-http`, a small HTTP
//! server with one page (an SVG speedometer) fed by server-sent events, as the seed's
//! `web_gauge`. Hand-rolled on `std::net`: one page and one event stream do not justify a
//! web framework, and a thread per client keeps slow or vanished clients from stalling the
//! transfer.

use std::io::{IsTerminal, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use super::Error;

/// The page served at `/`.
const PAGE: &str = include_str!("page.html");
/// Most concurrent HTTP clients; more get 503.
const MAX_CLIENTS: usize = 64;
/// Largest request head accepted.
const MAX_HEAD: usize = 8192;

/// Transfer progress shared between the data path and the gauges.
pub struct Progress {
    /// When the progress was made; [`Progress::begin`] moves the start later.
    base: Instant,
    /// Nanoseconds from `base` to the start of the transfer.
    began: AtomicU64,
    bytes: AtomicU64,
    total: Option<u64>,
    done: AtomicBool,
    /// 0 unknown, 1 checksum OK, 2 failed.
    verdict: AtomicU64,
    /// Nanoseconds from `start` to the end, set with `done`: the final figures stay fixed
    /// however long the gauge lingers.
    end_nanos: AtomicU64,
}

impl Progress {
    /// Progress towards `total` bytes (unknown for a stream that runs until it ends).
    pub fn new(total: Option<u64>) -> Arc<Progress> {
        Arc::new(Progress {
            base: Instant::now(),
            began: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            total,
            done: AtomicBool::new(false),
            verdict: AtomicU64::new(0),
            end_nanos: AtomicU64::new(0),
        })
    }

    /// Marks now as the start of the transfer (after waiting for a viewer): the elapsed
    /// time and the final rate count from here.
    pub fn begin(&self) {
        let n = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.began.store(n, Ordering::Relaxed);
    }

    /// The start of the transfer.
    fn start(&self) -> Instant {
        self.base + Duration::from_nanos(self.began.load(Ordering::Relaxed))
    }

    /// Counts `n` more bytes moved.
    pub fn add(&self, n: u64) {
        self.bytes.fetch_add(n, Ordering::Relaxed);
    }

    /// Marks the end of the transfer, with whether it verified.
    pub fn finish(&self, ok: bool) {
        self.verdict.store(if ok { 1 } else { 2 }, Ordering::Relaxed);
        let end = u64::try_from(self.start().elapsed().as_nanos()).unwrap_or(u64::MAX).max(1);
        self.end_nanos.store(end, Ordering::Relaxed);
        self.done.store(true, Ordering::Release);
    }

    fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// One event: `prev` is the previous sample (bytes, instant) for the rate.
    fn event(&self, prev: &mut (u64, Instant)) -> String {
        let done = self.is_done();
        let bytes = self.bytes();
        let now = Instant::now();
        let elapsed = if done {
            std::time::Duration::from_nanos(self.end_nanos.load(Ordering::Relaxed)).as_secs_f64()
        } else {
            now.saturating_duration_since(self.start()).as_secs_f64()
        };
        let rate = if done {
            bytes as f64 / elapsed.max(1e-9)
        } else {
            let dt = now.duration_since(prev.1).as_secs_f64();
            (bytes.saturating_sub(prev.0)) as f64 / dt.max(1e-9)
        };
        *prev = (bytes, now);
        let ok = match self.verdict.load(Ordering::Relaxed) {
            1 => serde_json::Value::Bool(true),
            2 => serde_json::Value::Bool(false),
            _ => serde_json::Value::Null,
        };
        serde_json::json!({
            "bytes": bytes, "rate": rate, "elapsed": elapsed, "done": done,
            "total": self.total, "ok": ok,
        })
        .to_string()
    }
}

/// The terminal gauge: a progress bar on stderr, drawn only when both stdout and stderr
/// are terminals. Updated by a thread until the transfer is done.
pub fn terminal(progress: &Arc<Progress>) -> Option<std::thread::JoinHandle<()>> {
    if !(std::io::stdout().is_terminal() && std::io::stderr().is_terminal()) {
        return None;
    }
    let bar = match progress.total {
        Some(t) => ProgressBar::new(t),
        None => ProgressBar::new_spinner(),
    };
    let template = if progress.total.is_some() {
        "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {elapsed}"
    } else {
        "{spinner} {binary_bytes} {binary_bytes_per_sec} {elapsed}"
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    let p = progress.clone();
    Some(std::thread::spawn(move || {
        while !p.is_done() {
            bar.set_position(p.bytes());
            std::thread::sleep(Duration::from_millis(100));
        }
        bar.finish_and_clear();
    }))
}

/// The HTTP gauge server.
pub struct HttpGauge {
    addr: SocketAddr,
    /// Event streams open now.
    streams: Arc<AtomicUsize>,
    /// Event streams ever opened.
    opened: Arc<AtomicUsize>,
    interval: Duration,
}

impl HttpGauge {
    /// Binds `addr` and serves `/` (the page) and `/events` (the event stream, one JSON
    /// event per `interval`) from a background thread.
    pub fn start(addr: SocketAddr, progress: Arc<Progress>, interval: Duration) -> Result<HttpGauge, Error> {
        let listener = TcpListener::bind(addr)
            .map_err(|source| Error::Io { what: format!("--gauge-http {addr}"), source })?;
        let addr =
            listener.local_addr().map_err(|source| Error::Io { what: "getsockname".into(), source })?;
        let streams = Arc::new(AtomicUsize::new(0));
        let opened = Arc::new(AtomicUsize::new(0));
        let clients = Arc::new(AtomicUsize::new(0));
        let (st, op) = (streams.clone(), opened.clone());
        std::thread::spawn(move || {
            let mut failing = false;
            for conn in listener.incoming() {
                let s = match conn {
                    Ok(s) => {
                        failing = false;
                        s
                    }
                    Err(e) => {
                        // Out of descriptors (EMFILE) fails again at once while the client
                        // waits in the backlog: wait instead of spinning a core.
                        if !std::mem::replace(&mut failing, true) {
                            eprintln!("rdmakit-perf: gauge: accept failed: {e}; trying again every 100 ms");
                        }
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                };
                let (p, st, op, cl) = (progress.clone(), st.clone(), op.clone(), clients.clone());
                if cl.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
                    cl.fetch_sub(1, Ordering::AcqRel);
                    let _ = respond(&s, "503 Service Unavailable", "text/plain", b"too many clients\n");
                    continue;
                }
                std::thread::spawn(move || {
                    serve(s, &p, (&st, &op), interval);
                    cl.fetch_sub(1, Ordering::AcqRel);
                });
            }
        });
        Ok(HttpGauge { addr, streams, opened, interval })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until a client has opened the event stream (a page is watching), or `wait`
    /// passes; returns whether one did.
    pub fn wait_for_viewer(&self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        while self.opened.load(Ordering::Acquire) == 0 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// After [`Progress::finish`]: gives connected event streams time to send their final
    /// event (at most a few ticks), then keeps serving for `linger`.
    pub fn wind_down(&self, linger: Duration) {
        let start = Instant::now();
        let flush_by = start + self.interval * 4 + Duration::from_millis(500);
        while self.streams.load(Ordering::Acquire) > 0 && Instant::now() < flush_by {
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(rest) = linger.checked_sub(start.elapsed()) {
            std::thread::sleep(rest);
        }
    }
}

fn respond(s: &TcpStream, status: &str, ctype: &str, body: &[u8]) -> std::io::Result<()> {
    respond_with(s, status, ctype, body, true)
}

/// A whole response; a `HEAD` request gets the headers only (`with_body` false).
fn respond_with(
    mut s: &TcpStream,
    status: &str,
    ctype: &str,
    body: &[u8],
    with_body: bool,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\
         Cache-Control: no-store\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    if with_body {
        s.write_all(body)?;
    }
    s.flush()
}

/// Longest a client may take to send its whole request head: a client trickling it a
/// byte at a time must not hold one of the [`MAX_CLIENTS`] places for hours.
const HEAD_DEADLINE: Duration = Duration::from_secs(5);

/// Reads the request head (up to the blank line); `None` if it is too long, not UTF-8,
/// or the client went quiet or away, or took longer than [`HEAD_DEADLINE`] for it.
fn read_head(s: &mut TcpStream) -> Option<String> {
    let deadline = Instant::now() + HEAD_DEADLINE;
    let mut buf = Vec::with_capacity(512);
    let mut b = [0u8; 512];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && !buf.windows(2).any(|w| w == b"\n\n") {
        let left = deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
        if buf.len() > MAX_HEAD || s.set_read_timeout(Some(left)).is_err() {
            return None;
        }
        match s.read(&mut b) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
    String::from_utf8(buf).ok()
}

/// The target path of a `GET`/`HEAD` request line, or the error status to answer.
pub(crate) fn route(head: &str) -> Result<(&str, bool), &'static str> {
    let line = head.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("400 Bad Request");
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err("400 Bad Request");
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Err("405 Method Not Allowed"),
    };
    let path = target.split(['?', '#']).next().unwrap_or("/");
    Ok((path, head_only))
}

/// Serves one client; `streams` counts the event streams open now and ever opened.
fn serve(mut s: TcpStream, progress: &Progress, streams: (&AtomicUsize, &AtomicUsize), interval: Duration) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
    let Some(head) = read_head(&mut s) else {
        let _ = respond(&s, "400 Bad Request", "text/plain", b"bad request\n");
        return;
    };
    let (path, head_only) = match route(&head) {
        Ok(r) => r,
        Err(status) => {
            let _ = respond(&s, status, "text/plain", format!("{status}\n").as_bytes());
            return;
        }
    };
    match path {
        "/" | "/index.html" => {
            let _ = respond_with(&s, "200 OK", "text/html; charset=utf-8", PAGE.as_bytes(), !head_only);
        }
        "/events" => {
            streams.0.fetch_add(1, Ordering::AcqRel);
            if !head_only {
                streams.1.fetch_add(1, Ordering::AcqRel);
            }
            let _ = events(&mut s, progress, interval, head_only);
            streams.0.fetch_sub(1, Ordering::AcqRel);
        }
        _ => {
            let _ = respond(&s, "404 Not Found", "text/plain", b"not found\n");
        }
    }
}

/// The event stream: one `data:` line of JSON per tick, the last one with `"done":true`.
fn events(
    s: &mut TcpStream,
    progress: &Progress,
    interval: Duration,
    head_only: bool,
) -> std::io::Result<()> {
    s.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n\
          Connection: close\r\n\r\nretry: 2000\n\n",
    )?;
    if head_only {
        return Ok(());
    }
    let mut prev = (progress.bytes(), progress.start());
    loop {
        let done = progress.is_done();
        let ev = progress.event(&mut prev);
        s.write_all(format!("data: {ev}\n\n").as_bytes())?;
        s.flush()?;
        if done {
            return Ok(());
        }
        std::thread::sleep(interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(route("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), Ok(("/", false)));
        assert_eq!(route("HEAD /events?x=1 HTTP/1.0\r\n\r\n"), Ok(("/events", true)));
        assert_eq!(route("POST / HTTP/1.1\r\n\r\n"), Err("405 Method Not Allowed"));
        assert_eq!(route("GET\r\n\r\n"), Err("400 Bad Request"));
        assert_eq!(route("GET / HTTP/1.1 extra\r\n\r\n"), Err("400 Bad Request"));
        assert_eq!(route("GET nope HTTP/1.1\r\n\r\n"), Err("400 Bad Request"));
        assert_eq!(route(""), Err("400 Bad Request"));
    }

    #[test]
    fn events_are_json_with_the_counters() {
        let p = Progress::new(Some(10));
        p.add(7);
        let mut prev = (0, p.start());
        let v: serde_json::Value = serde_json::from_str(&p.event(&mut prev)).unwrap();
        assert_eq!(
            (v["bytes"].as_u64(), v["done"].as_bool(), v["total"].as_u64()),
            (Some(7), Some(false), Some(10))
        );
        p.finish(true);
        let v: serde_json::Value = serde_json::from_str(&p.event(&mut prev)).unwrap();
        assert_eq!((v["done"].as_bool(), v["ok"].as_bool()), (Some(true), Some(true)));
        // The final figures stay put while the gauge lingers.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let w: serde_json::Value = serde_json::from_str(&p.event(&mut prev)).unwrap();
        assert_eq!((&v["rate"], &v["elapsed"]), (&w["rate"], &w["elapsed"]));
    }
}
