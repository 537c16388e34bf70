//! The soft NIC between processes and hosts: QPs talk over TCP.
//!
//! Each soft device opens a TCP "port" the first time one of its QPs hands out an
//! endpoint (address from `RDMAKIT_SOFT_ADDR`, default `127.0.0.1:0`). A requester QP
//! connecting to a QP of another process opens one stream to that device and introduces
//! itself with a `Hello`; the device's thread for that stream is the target-side
//! progress engine: it applies each request to the target QP's memory through the same
//! responder code as in-process, and answers in order, without the target application.
//!
//! Requesters never hold a lock across blocking I/O: frames go to a writer thread through a
//! channel, and a reader thread hands responses back to the QP.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::SoftDevice;
use super::qp::{Requester, SharedTail, SoftQp};
use super::wire::{self, Frame, WireError};

/// Environment variable: the address soft devices listen on (`IP` or `IP:port`).
pub const SOFT_ADDR_ENV: &str = "RDMAKIT_SOFT_ADDR";

/// The listen address configured for new devices.
pub(crate) fn configured_addr() -> SocketAddrV4 {
    let v = std::env::var(SOFT_ADDR_ENV).unwrap_or_default();
    if let Ok(a) = v.parse::<SocketAddrV4>() {
        return a;
    }
    if let Ok(ip) = v.parse::<Ipv4Addr>() {
        return SocketAddrV4::new(ip, 0);
    }
    if !v.is_empty() {
        tracing::warn!(value = %v, "{SOFT_ADDR_ENV} is not an IPv4 address; using 127.0.0.1");
    }
    SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)
}

/// Starts the device's listener; returns its port.
pub(crate) fn listen(device: &Arc<SoftDevice>, addr: SocketAddrV4) -> std::io::Result<u16> {
    let listener = TcpListener::bind(addr)?;
    let port = listener.local_addr()?.port();
    let weak = Arc::downgrade(device);
    std::thread::Builder::new().name(format!("rdmakit-{}-port", device.name())).spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            if weak.strong_count() == 0 {
                return;
            }
            let weak = weak.clone();
            let spawned = std::thread::Builder::new()
                .name("rdmakit-soft-responder".into())
                .spawn(move || serve(stream, weak));
            if let Err(e) = spawned {
                tracing::error!(%e, "soft NIC: cannot start a responder thread");
            }
        }
    })?;
    Ok(port)
}

fn read_frame(r: &mut impl Read, buf: &mut Vec<u8>) -> Result<Option<Frame>, String> {
    let mut h = [0u8; wire::HEADER];
    match r.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.to_string()),
    }
    let (kind, len) = wire::decode_header(&h).map_err(|e: WireError| e.to_string())?;
    let len = len as usize;
    buf.clear();
    match wire::data_offset(kind) {
        // Data-carrying frames: the fixed fields, then the data read straight into the
        // vector the frame keeps (no zero-fill, no second copy).
        Some(fixed) if len >= fixed => {
            buf.resize(fixed, 0);
            r.read_exact(buf).map_err(|e| e.to_string())?;
            let n = len - fixed;
            let mut data = Vec::with_capacity(n);
            let got = r.take(n as u64).read_to_end(&mut data).map_err(|e| e.to_string())?;
            if got != n {
                return Err(format!("connection closed inside a frame ({got} of {n} data bytes)"));
            }
            wire::decode_payload_split(kind, buf, data).map(Some).map_err(|e| e.to_string())
        }
        _ => {
            buf.resize(len, 0);
            r.read_exact(buf).map_err(|e| e.to_string())?;
            wire::decode_payload(kind, buf).map(Some).map_err(|e| e.to_string())
        }
    }
}

/// Writes a request frame whose payload is either in the frame or, as `tail`, still in the
/// requester's registered region: then the header goes through the buffer and the payload
/// straight from the region to the socket (`send(2)` reads it; no Rust reference is formed
/// over memory the NIC's peers may write).
fn write_request(
    w: &mut BufWriter<TcpStream>,
    f: &Frame,
    tail: Option<SharedTail>,
    scratch: &mut Vec<u8>,
) -> std::io::Result<()> {
    let Some(tail) = tail else { return write_frame(w, f, scratch) };
    scratch.clear();
    let inline = wire::encode_split(f, scratch);
    debug_assert!(inline.is_empty(), "a shared payload's frame carries no data");
    // The header's length counts the payload that follows from the region.
    let len = u32::from_le_bytes([scratch[4], scratch[5], scratch[6], scratch[7]]) as usize + tail.len;
    scratch[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    w.write_all(scratch)?;
    w.flush()?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(w.get_ref());
    let mut sent = 0;
    while sent < tail.len {
        // SAFETY: `tail.ptr` is valid for `tail.len` bytes while `tail` (holding the region's
        // entry) lives; the kernel only reads it. MSG_NOSIGNAL: a closed peer is an error,
        // not SIGPIPE.
        let n = unsafe { libc::send(fd, tail.ptr.add(sent).cast(), tail.len - sent, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(())
}

/// Writes `f`; a large payload goes to the writer without passing through `scratch`.
fn write_frame(w: &mut impl Write, f: &Frame, scratch: &mut Vec<u8>) -> std::io::Result<()> {
    scratch.clear();
    let data = wire::encode_split(f, scratch);
    w.write_all(scratch)?;
    w.write_all(data)
}

/// Serves one incoming stream: the target side of one requester QP.
fn serve(stream: TcpStream, device: Weak<SoftDevice>) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_nodelay(true);
    let Ok(read_half) = stream.try_clone() else { return };
    let mut r = BufReader::with_capacity(256 * 1024, read_half);
    let mut w = BufWriter::with_capacity(64 * 1024, stream);
    let (mut buf, mut scratch) = (Vec::new(), Vec::new());
    // The first frame must be a Hello naming a QP of this device.
    let _ = r.get_ref().set_read_timeout(Some(Duration::from_secs(10)));
    let (from_gid, from_qpn, qp) = match read_frame(&mut r, &mut buf) {
        Ok(Some(Frame::Hello { src_gid, src_qpn, dst_qpn })) => {
            let qp = device.upgrade().and_then(|d| d.find_qp(dst_qpn));
            let status = u8::from(qp.is_none());
            if write_frame(&mut w, &Frame::HelloAck { status }, &mut scratch).and_then(|_| w.flush()).is_err()
            {
                return;
            }
            match qp {
                Some(qp) => (src_gid, src_qpn, Arc::downgrade(&qp)),
                None => return,
            }
        }
        Ok(Some(other)) => {
            tracing::error!(?peer, frame = ?kind_name(&other), "soft NIC: connection did not start with Hello; dropped");
            return;
        }
        Ok(None) => return,
        Err(e) => {
            tracing::error!(?peer, error = %e, "soft NIC: malformed Hello; connection dropped");
            return;
        }
    };
    let _ = r.get_ref().set_read_timeout(None);
    let requester = Requester::remote(from_gid, from_qpn);
    // Go-back-N: after an RNR NAK, requests are dropped until the NAKed one comes again.
    let mut expected: Option<u32> = None;
    loop {
        // Flush replies before a read that may block (nothing more buffered): batches
        // replies under load, and no reply waits behind a request that gets dropped.
        if r.buffer().is_empty() && w.flush().is_err() {
            return;
        }
        let frame = match read_frame(&mut r, &mut buf) {
            Ok(Some(f)) => f,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(?peer, error = %e, "soft NIC: malformed frame; connection dropped");
                return;
            }
        };
        let Some(psn) = request_psn(&frame) else {
            tracing::error!(?peer, frame = ?kind_name(&frame), "soft NIC: unexpected frame from a requester; connection dropped");
            return;
        };
        if expected.is_some_and(|e| e != psn) {
            continue;
        }
        // A destroyed target QP answers nothing: the requester times out, as on a real NIC.
        let Some(target) = qp.upgrade() else { continue };
        // `None`: the target QP is not connected to this requester (any more): drop, as a
        // NIC drops such packets; the requester times out.
        let Some(reply) = target.serve_remote(&requester, frame) else { continue };
        expected = Some(match reply {
            Frame::RnrNak { .. } => psn,
            _ => psn.wrapping_add(1),
        });
        if write_frame(&mut w, &reply, &mut scratch).is_err() {
            return;
        }
    }
}

fn request_psn(f: &Frame) -> Option<u32> {
    match f {
        Frame::Write { psn, .. }
        | Frame::Read { psn, .. }
        | Frame::Send { psn, .. }
        | Frame::FetchAdd { psn, .. }
        | Frame::CmpSwap { psn, .. } => Some(*psn),
        _ => None,
    }
}

fn kind_name(f: &Frame) -> &'static str {
    match f {
        Frame::Hello { .. } => "Hello",
        Frame::HelloAck { .. } => "HelloAck",
        Frame::Write { .. } => "Write",
        Frame::Read { .. } => "Read",
        Frame::Send { .. } => "Send",
        Frame::FetchAdd { .. } => "FetchAdd",
        Frame::CmpSwap { .. } => "CmpSwap",
        Frame::Ack { .. } => "Ack",
        Frame::RnrNak { .. } => "RnrNak",
    }
}

/// A requester's connection to a remote QP.
pub(crate) struct TcpLink {
    tx: mpsc::Sender<(Frame, Option<SharedTail>)>,
    dead: Arc<AtomicBool>,
}

impl TcpLink {
    /// Connects QP `qp` to QP `dst_qpn` of the device listening at `addr`.
    ///
    /// Errors are not returned: as on a real RC QP, an unreachable peer shows up as
    /// requests that complete with `RETRY_EXC_ERR`. The link is then dead from the start.
    pub fn connect(qp: &Arc<SoftQp>, addr: SocketAddr, dst_qpn: u32) -> TcpLink {
        let dead = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<(Frame, Option<SharedTail>)>();
        match handshake(qp, addr, dst_qpn) {
            Ok(stream) => {
                let weak = Arc::downgrade(qp);
                if let Err(e) = spawn_io(stream, rx, weak, dead.clone()) {
                    tracing::error!(%e, "soft NIC: cannot start link threads");
                    dead.store(true, Ordering::Release);
                }
            }
            Err(e) => {
                tracing::warn!(%addr, dst_qpn, error = %e, "soft NIC: peer unreachable; requests will time out");
                dead.store(true, Ordering::Release);
            }
        }
        TcpLink { tx, dead }
    }

    /// Queues a request frame, with its payload still in the region when `tail` is given.
    /// False if the link is down.
    pub fn send(&self, f: Frame, tail: Option<SharedTail>) -> bool {
        !self.is_dead() && self.tx.send((f, tail)).is_ok()
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }
}

fn handshake(qp: &Arc<SoftQp>, addr: SocketAddr, dst_qpn: u32) -> Result<TcpStream, String> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let mut scratch = Vec::new();
    let hello = Frame::Hello { src_gid: qp.device().gid(), src_qpn: qp.qpn(), dst_qpn };
    write_frame(&mut &stream, &hello, &mut scratch).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    match read_frame(&mut &stream, &mut scratch)? {
        Some(Frame::HelloAck { status: 0 }) => {}
        Some(Frame::HelloAck { .. }) => return Err(format!("the peer has no QP {dst_qpn:#x}")),
        other => return Err(format!("unexpected handshake reply {:?}", other.as_ref().map(kind_name))),
    }
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    Ok(stream)
}

fn spawn_io(
    stream: TcpStream,
    rx: mpsc::Receiver<(Frame, Option<SharedTail>)>,
    qp: Weak<SoftQp>,
    dead: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let read_half = stream.try_clone()?;
    let dead_w = dead.clone();
    std::thread::Builder::new().name("rdmakit-soft-tx".into()).spawn(move || {
        let mut w = BufWriter::with_capacity(256 * 1024, stream);
        let mut scratch = Vec::new();
        // Write each frame; flush when the queue is momentarily empty.
        while let Ok((f, tail)) = rx.recv() {
            let mut ok = write_request(&mut w, &f, tail, &mut scratch).is_ok();
            while ok {
                match rx.try_recv() {
                    Ok((f, tail)) => ok = write_request(&mut w, &f, tail, &mut scratch).is_ok(),
                    Err(_) => break,
                }
            }
            if !ok || w.flush().is_err() {
                dead_w.store(true, Ordering::Release);
                let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
                return;
            }
        }
        // The QP is gone (sender dropped): close the stream.
        let _ = w.get_ref().shutdown(std::net::Shutdown::Both);
    })?;
    std::thread::Builder::new().name("rdmakit-soft-rx".into()).spawn(move || {
        let mut r = BufReader::with_capacity(256 * 1024, read_half);
        let mut buf = Vec::new();
        loop {
            match read_frame(&mut r, &mut buf) {
                Ok(Some(f @ (Frame::Ack { .. } | Frame::RnrNak { .. }))) => match qp.upgrade() {
                    Some(qp) => qp.on_remote_response(f),
                    None => break,
                },
                Ok(Some(other)) => {
                    tracing::error!(
                        frame = kind_name(&other),
                        "soft NIC: unexpected frame from a responder; link dropped"
                    );
                    break;
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(error = %e, "soft NIC: malformed response; link dropped");
                    break;
                }
            }
        }
        // Outstanding requests now time out (RETRY_EXC_ERR) on the QP's transport budget.
        dead.store(true, Ordering::Release);
    })?;
    Ok(())
}
