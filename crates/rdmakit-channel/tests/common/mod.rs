//! Set-up shared by the channel crate's test binaries: connected endpoint pairs on the
//! soft NIC, in process.

#![allow(dead_code)] // each test binary uses its own part

use std::time::Duration;

use rdmakit_channel::PollMode;
use rdmakit_channel::heap::{HeapEndpoint, OwnerLimits};
use rdmakit_channel::put::PutEndpoint;
use rdmakit_verbs::*;

/// Connection options for the cross-process tests: a pipe's QP, and a transport budget of
/// about a second (4.096 µs × 2^16 per try, 4 tries): a dead peer shows quickly, a peer
/// slowed by a loaded machine does not look dead.
pub fn cm_options() -> rdmakit_verbs::cm::CmOptions {
    let mut o = rdmakit_verbs::cm::CmOptions::default();
    o.caps.max_inline_data = 64;
    o.caps.max_recv_wr = 160;
    o.caps.max_send_wr = 256;
    o.cqe = 1024;
    o.connect.timeout = 16;
    o.connect.retry_cnt = 3;
    o
}

/// Two connected QPs with `caps`, each with its own CQ.
pub fn qp_pair(
    pd: &ProtectionDomain,
    caps: QpCaps,
) -> ((QueuePair, CompletionQueue), (QueuePair, CompletionQueue)) {
    let ctx = pd.context();
    let (ca, cb) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
    let a = pd.create_qp(&ca, &ca, caps).unwrap();
    let b = pd.create_qp(&cb, &cb, caps).unwrap();
    a.connect(&b.address().unwrap(), &ConnectOptions::default()).unwrap();
    b.connect(&a.address().unwrap(), &ConnectOptions::default()).unwrap();
    ((a, ca), (b, cb))
}

/// Two connected put endpoints (busy polling).
pub fn put_endpoints(pd: &ProtectionDomain) -> (PutEndpoint, PutEndpoint) {
    let ((a, ca), (b, cb)) = qp_pair(pd, QpCaps::default().with_max_inline_data(64));
    (PutEndpoint::new(a, ca, PollMode::Busy).unwrap(), PutEndpoint::new(b, cb, PollMode::Busy).unwrap())
}

/// Two connected heap endpoints with `limits` and `timeout`.
pub fn heap_endpoints(
    pd: &ProtectionDomain,
    limits: OwnerLimits,
    timeout: Duration,
) -> (HeapEndpoint, HeapEndpoint) {
    let ((a, ca), (b, cb)) = qp_pair(pd, QpCaps::default());
    (HeapEndpoint::new(a, ca, limits, timeout).unwrap(), HeapEndpoint::new(b, cb, limits, timeout).unwrap())
}

/// A log writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with this thread's log captured: what it returned, and the log's text.
pub fn with_captured_log<R>(f: impl FnOnce() -> R) -> (R, String) {
    let log = Captured::default();
    let sink = log.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || sink.clone()).with_ansi(false).finish();
    let r = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    (r, text)
}
