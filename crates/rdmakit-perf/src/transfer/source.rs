//! Where the sender's bytes come from: a built-in pattern generator, or a TCP stream (the
//! `datagen` subcommand, or any device that streams raw bytes), and the generator server.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::Error;

/// The pattern's period: a prime, so that chunks of any power-of-two size start at
/// different phases and a chunk written into the wrong slot changes the checksum.
const PERIOD: usize = 65_521;

/// Clients `datagen` serves at once (a thread each).
pub(crate) const MAX_CLIENTS: usize = 64;

/// A deterministic byte stream: byte `p` of the stream is `table[p % PERIOD]`.
pub struct Pattern {
    /// The period twice over, so any window of up to `PERIOD` bytes is contiguous.
    table: Vec<u8>,
    pos: u64,
}

impl Default for Pattern {
    fn default() -> Self {
        Self::new()
    }
}

impl Pattern {
    /// A generator at stream position 0.
    pub fn new() -> Pattern {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut table = Vec::with_capacity(2 * PERIOD);
        for _ in 0..PERIOD {
            // xorshift64*: cheap, and not a short cycle of bytes.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            table.push((x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8);
        }
        table.extend_from_within(..);
        Pattern { table, pos: 0 }
    }

    /// Hands the next `len` bytes of the stream to `sink`, in contiguous pieces.
    pub fn next(
        &mut self,
        mut len: usize,
        mut sink: impl FnMut(&[u8]) -> Result<(), Error>,
    ) -> Result<(), Error> {
        while len > 0 {
            let at = (self.pos % PERIOD as u64) as usize;
            let n = len.min(PERIOD);
            sink(&self.table[at..at + n])?;
            self.pos += n as u64;
            len -= n;
        }
        Ok(())
    }
}

/// Parses `tcp://HOST:PORT` and connects. A read then waits `stuck` at most (a source that
/// stalls, or whose host is gone without closing, is an error, not a wait for ever).
pub fn connect_input(url: &str, stuck: Duration) -> Result<TcpStream, Error> {
    let Some(rest) = url.strip_prefix("tcp://") else {
        return Err(Error::InvalidArgument(format!("--input {url}: expected tcp://HOST:PORT")));
    };
    let addrs: Vec<SocketAddr> = rest
        .to_socket_addrs()
        .map_err(|source| Error::Input { what: format!("resolve {rest}"), source })?
        .collect();
    let mut last = None;
    for a in addrs {
        match TcpStream::connect_timeout(&a, Duration::from_secs(10)) {
            Ok(s) => {
                s.set_read_timeout(Some(stuck.max(Duration::from_millis(1))))
                    .map_err(|source| Error::Input { what: format!("set a read timeout on {a}"), source })?;
                return Ok(s);
            }
            Err(e) => last = Some((a, e)),
        }
    }
    match last {
        Some((a, source)) => Err(Error::Input { what: format!("connect to {a}"), source }),
        None => Err(Error::InvalidArgument(format!("--input {url}: {rest} resolves to no address"))),
    }
}

/// Reads until `buf` is full or the stream ends; returns how many bytes were read.
pub fn read_full(input: &mut impl Read, buf: &mut [u8]) -> Result<usize, Error> {
    let mut got = 0;
    while got < buf.len() {
        match input.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source)
                if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
            {
                let what = "read the input stream (no data within --timeout)".into();
                return Err(Error::Input { what, source });
            }
            Err(source) => return Err(Error::Input { what: "read the input stream".into(), source }),
        }
    }
    Ok(got)
}

/// What `datagen` sent on one connection.
pub struct Sent {
    /// Bytes written.
    pub bytes: u64,
    /// CRC-32 of them.
    pub crc32: u32,
}

/// Streams the pattern to `out`: `limit` bytes (or until the peer goes away when `None`),
/// at most `rate` bytes per second when given.
pub fn stream(out: &mut impl Write, limit: Option<u64>, rate: Option<f64>) -> Sent {
    const PIECE: usize = 64 * 1024;
    let mut pattern = Pattern::new();
    let mut crc = crc32fast::Hasher::new();
    let mut sent = 0u64;
    let start = Instant::now();
    loop {
        let n = limit.map_or(PIECE as u64, |l| (l - sent).min(PIECE as u64)) as usize;
        if n == 0 {
            break;
        }
        if let Some(r) = rate {
            // Pace: do not get ahead of `rate` bytes per second since the start.
            let due = Duration::from_secs_f64(sent as f64 / r);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        let r = pattern.next(n, |piece| {
            out.write_all(piece).map_err(|source| Error::Input { what: "write".into(), source })?;
            crc.update(piece);
            Ok(())
        });
        if r.is_err() {
            break; // the reader went away: what it got is what was sent up to here
        }
        sent += n as u64;
    }
    Sent { bytes: sent, crc32: crc.finalize() }
}

/// Prints a line on stdout; a closed stdout is not an error worth dying for.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// `datagen`: serves the pattern to each TCP client (one at a time with `once`, otherwise
/// a thread per client, at most [`MAX_CLIENTS`] at once). Prints its address first, and
/// one line per finished client.
pub fn datagen(
    listen: SocketAddr,
    rate_mb: Option<f64>,
    bytes: Option<u64>,
    once: bool,
    write_timeout: Duration,
) -> Result<(), Error> {
    let listener = TcpListener::bind(listen)
        .map_err(|source| Error::Input { what: format!("listen on {listen}"), source })?;
    let addr = listener.local_addr().map_err(|source| Error::Input { what: "getsockname".into(), source })?;
    let rate = match rate_mb {
        // At least a byte a second: the pacing's sleep must be a duration.
        Some(r) if !(r * (1u64 << 20) as f64 >= 1.0 && r.is_finite()) => {
            return Err(Error::InvalidArgument(format!("--rate {r}: MB/s, at least one byte a second")));
        }
        Some(r) => Some(r * (1u64 << 20) as f64),
        None => None,
    };
    say(&format!("datagen: listening on {addr}"));
    let serve = move |mut s: TcpStream| {
        let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let _ = s.set_nodelay(true);
        // A client that stops reading must not hold its place (and thread) for ever.
        let _ = s.set_write_timeout(Some(write_timeout));
        let sent = stream(&mut s, bytes, rate);
        let _ = s.shutdown(std::net::Shutdown::Write);
        say(&format!("datagen: sent {} bytes to {peer}, crc32 {:#010x}", sent.bytes, sent.crc32));
    };
    let serving = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut failing = false;
    for conn in listener.incoming() {
        let s = match conn {
            Ok(s) => {
                failing = false;
                s
            }
            Err(e) => {
                // Out of descriptors (EMFILE) fails again at once while the client waits in
                // the backlog: wait instead of spinning a core.
                if !std::mem::replace(&mut failing, true) {
                    eprintln!("datagen: accept: {e}; trying again every 100 ms");
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if once {
            serve(s);
            return Ok(());
        }
        // A thread per client, up to MAX_CLIENTS at once: more are closed at once.
        use std::sync::atomic::Ordering::AcqRel;
        if serving.fetch_add(1, AcqRel) >= MAX_CLIENTS {
            serving.fetch_sub(1, AcqRel);
            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
            eprintln!("datagen: {MAX_CLIENTS} clients served already; {peer} refused");
            // A reset, not a clean end: a client must not take an empty stream for the data.
            let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
            continue; // dropping `s` resets it
        }
        // Gives the place back however the thread ends (a panic included), or if it
        // cannot be started.
        struct Place(std::sync::Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Place {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            }
        }
        let place = Place(serving.clone());
        if let Err(e) = std::thread::Builder::new().spawn(move || {
            let _place = place;
            serve(s);
        }) {
            eprintln!("datagen: cannot start a thread for a client: {e}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_the_same_stream_whatever_the_pieces() {
        let mut a = Vec::new();
        Pattern::new()
            .next(200_000, |p| {
                a.extend_from_slice(p);
                Ok(())
            })
            .unwrap();
        let mut b = Vec::new();
        let mut g = Pattern::new();
        for n in [1, 7, 65_521, 100_000, 34_471] {
            g.next(n, |p| {
                b.extend_from_slice(p);
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(a, b);
        assert_ne!(a[..1 << 16], a[1 << 16..2 << 16], "chunks at different phases differ");
    }

    #[test]
    fn stream_honours_the_limit_and_its_crc_is_of_what_was_written() {
        let mut out = Vec::new();
        let s = stream(&mut out, Some(300_000), None);
        assert_eq!((s.bytes, out.len()), (300_000, 300_000));
        assert_eq!(s.crc32, crc32fast::hash(&out));
    }

    /// A source that accepts and then sends nothing (stalled, or its host gone without a
    /// close): the read is an error after the stuck time, where it waited for ever.
    #[test]
    fn a_stalled_input_stream_is_an_error_after_the_stuck_time() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("tcp://{}", l.local_addr().unwrap());
        let mut input = connect_input(&url, Duration::from_millis(300)).unwrap();
        let (_silent, _) = l.accept().unwrap();
        let started = std::time::Instant::now();
        let e = read_full(&mut input, &mut [0u8; 64]).expect_err("nothing came");
        assert!(e.to_string().contains("no data within --timeout"), "{e}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn bad_input_urls_are_errors() {
        assert!(matches!(
            connect_input("udp://1.2.3.4:5", Duration::from_secs(1)),
            Err(Error::InvalidArgument(_))
        ));
        assert!(connect_input("tcp://no-port", Duration::from_secs(1)).is_err());
    }
}
