//! The soft NIC's wire format between processes: length-prefixed frames over TCP.
//!
//! Every frame is `magic "RK" | version 2 | kind | payload length (u32 LE) | payload`. The
//! decoder is total: any byte string gives a frame or a `WireError`, never a panic, and
//! never allocates more than the declared length (itself capped by `MAX_PAYLOAD`). A peer
//! sending garbage gets its connection dropped with an error logged.
//!
//! Readers check a header's length against what its kind may carry
//! (`check_length`) *before* reserving memory for the payload: every kind but the three
//! data-carrying ones has one fixed length, and those carry at most `MAX_MESSAGE` bytes.
//!
//! Version 2 made the `Hello` an authenticator: besides naming the requester and the target
//! QP, it proves that the client is the peer the target QP was connected to (both initial
//! PSNs from the exchanged endpoints, and the target QP's connection token: the random one
//! its `QpAddress` carries, or the one the soft bootstrap exchanged).

use std::fmt;

/// Frame header length.
pub const HEADER: usize = 8;
/// Largest payload accepted: bounds the memory a peer can make us allocate.
pub const MAX_PAYLOAD: u32 = 64 << 20;
/// Largest message the soft NIC moves between processes (one frame's data).
pub const MAX_MESSAGE: u32 = MAX_PAYLOAD - 64;

const MAGIC: [u8; 2] = *b"RK";
const VERSION: u8 = 2;

/// Payload length of a `Hello`.
pub const HELLO_LEN: usize = 16 + 4 + 4 + 4 + 4 + 16;

/// One frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// First frame of a connection: requester QP `src_qpn` on device `src_gid` talks to QP
    /// `dst_qpn` of the accepting device. `src_psn` and `dst_psn` are the two QPs' initial
    /// PSNs and `token` the target QP's connection token (random per QP and carried in its
    /// endpoint, or exchanged by the soft bootstrap): what only the connected peer knows.
    Hello { src_gid: [u8; 16], src_qpn: u32, dst_qpn: u32, src_psn: u32, dst_psn: u32, token: [u8; 16] },
    /// Answer to `Hello`: 0 accepted, 1 no such QP.
    HelloAck { status: u8 },
    /// RDMA write (optionally with immediate).
    Write { psn: u32, addr: u64, rkey: u32, imm: Option<u32>, data: Vec<u8> },
    /// RDMA read of `len` bytes.
    Read { psn: u32, addr: u64, rkey: u32, len: u32 },
    /// Send (optionally with immediate).
    Send { psn: u32, imm: Option<u32>, data: Vec<u8> },
    /// Fetch-and-add.
    FetchAdd { psn: u32, addr: u64, rkey: u32, add: u64 },
    /// Compare-and-swap.
    CmpSwap { psn: u32, addr: u64, rkey: u32, compare: u64, swap: u64 },
    /// Response: the request `psn` completed with `status` (a `WcStatus` value); `data` is
    /// the read data or the atomic's original value.
    Ack { psn: u32, status: u32, data: Vec<u8> },
    /// Response: no receive was posted for request `psn`; it and the requests after it
    /// were dropped and must be sent again.
    RnrNak { psn: u32 },
    /// Same-host rings only: the requester asks to map the region of `rkey` itself, to
    /// place its writes and take its reads without the responder's loop (see
    /// `super::direct`). Carries no PSN: it is not a request of the send queue.
    KeyRequest { rkey: u32 },
    /// Answer to `KeyRequest`: `access` (remote write and/or read bits of
    /// [`AccessFlags`](crate::AccessFlags)) is 0 for a refusal; otherwise the region's memfd
    /// (`map_len` bytes, the region's `len` bytes addressed from `addr` at offset 0) and the
    /// responder's status file came on the doorbell socket just before this frame; the
    /// status file's word `slot` holds `tag` while the region is registered; `ino` is the
    /// region file's inode (the requester checks the descriptor it took is that file).
    KeyGrant { rkey: u32, access: u32, addr: u64, len: u64, map_len: u64, slot: u32, tag: u64, ino: u64 },
}

/// Why bytes are not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireError {
    /// Fewer bytes than the header or the declared payload; more may come.
    Incomplete { need: usize },
    /// Not an rdmakit frame (bad magic or version).
    BadHeader,
    /// A payload longer than [`MAX_PAYLOAD`].
    TooLong(u32),
    /// An unknown frame kind.
    UnknownKind(u8),
    /// A payload whose length does not match its kind.
    BadLength { kind: u8, len: usize },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Incomplete { need } => write!(f, "incomplete frame: {need} more bytes needed"),
            WireError::BadHeader => f.write_str("bad frame header (magic or version)"),
            WireError::TooLong(n) => write!(f, "frame payload of {n} bytes exceeds {MAX_PAYLOAD}"),
            WireError::UnknownKind(k) => write!(f, "unknown frame kind {k}"),
            WireError::BadLength { kind, len } => write!(f, "frame kind {kind} with a {len}-byte payload"),
        }
    }
}

impl std::error::Error for WireError {}

mod kind {
    pub const HELLO: u8 = 1;
    pub const HELLO_ACK: u8 = 2;
    pub const WRITE: u8 = 10;
    pub const READ: u8 = 11;
    pub const SEND: u8 = 12;
    pub const FETCH_ADD: u8 = 13;
    pub const CMP_SWAP: u8 = 14;
    pub const ACK: u8 = 20;
    pub const RNR_NAK: u8 = 21;
    pub const KEY_REQUEST: u8 = 30;
    pub const KEY_GRANT: u8 = 31;
}

/// Parses a header: the kind and the payload length.
pub fn decode_header(h: &[u8]) -> Result<(u8, u32), WireError> {
    if h.len() < HEADER {
        return Err(WireError::Incomplete { need: HEADER - h.len() });
    }
    if h[..2] != MAGIC || h[2] != VERSION {
        return Err(WireError::BadHeader);
    }
    let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    if len > MAX_PAYLOAD {
        return Err(WireError::TooLong(len));
    }
    Ok((h[3], len))
}

/// Decodes one frame from the start of `buf`; returns it and the bytes it used.
pub fn decode(buf: &[u8]) -> Result<(Frame, usize), WireError> {
    let (k, len) = decode_header(buf)?;
    let total = HEADER + len as usize;
    if buf.len() < total {
        return Err(WireError::Incomplete { need: total - buf.len() });
    }
    Ok((decode_payload(k, &buf[HEADER..total])?, total))
}

/// A little-endian reader over a payload that never reads past its end.
struct Rd<'a>(&'a [u8]);

impl Rd<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    fn imm(&mut self) -> Option<Option<u32>> {
        let flag = self.u8()?;
        let v = self.u32()?;
        match flag {
            0 => Some(None),
            1 => Some(Some(v)),
            _ => None,
        }
    }
    fn rest(self) -> Vec<u8> {
        self.0.to_vec()
    }
    fn end(&self) -> Option<()> {
        self.0.is_empty().then_some(())
    }
}

/// Decodes a payload of kind `k`.
pub fn decode_payload(k: u8, p: &[u8]) -> Result<Frame, WireError> {
    let bad = || WireError::BadLength { kind: k, len: p.len() };
    let mut r = Rd(p);
    let frame = match k {
        kind::HELLO => {
            let src_gid = r.take::<16>().ok_or_else(bad)?;
            let src_qpn = r.u32().ok_or_else(bad)?;
            let dst_qpn = r.u32().ok_or_else(bad)?;
            let src_psn = r.u32().ok_or_else(bad)?;
            let dst_psn = r.u32().ok_or_else(bad)?;
            let token = r.take::<16>().ok_or_else(bad)?;
            r.end().ok_or_else(bad)?;
            Frame::Hello { src_gid, src_qpn, dst_qpn, src_psn, dst_psn, token }
        }
        kind::HELLO_ACK => {
            let status = r.u8().ok_or_else(bad)?;
            r.end().ok_or_else(bad)?;
            Frame::HelloAck { status }
        }
        kind::WRITE => {
            let (psn, addr, rkey) =
                (r.u32().ok_or_else(bad)?, r.u64().ok_or_else(bad)?, r.u32().ok_or_else(bad)?);
            let imm = r.imm().ok_or_else(bad)?;
            Frame::Write { psn, addr, rkey, imm, data: r.rest() }
        }
        kind::READ => {
            let (psn, addr, rkey) =
                (r.u32().ok_or_else(bad)?, r.u64().ok_or_else(bad)?, r.u32().ok_or_else(bad)?);
            let len = r.u32().ok_or_else(bad)?;
            r.end().ok_or_else(bad)?;
            Frame::Read { psn, addr, rkey, len }
        }
        kind::SEND => {
            let psn = r.u32().ok_or_else(bad)?;
            let imm = r.imm().ok_or_else(bad)?;
            Frame::Send { psn, imm, data: r.rest() }
        }
        kind::FETCH_ADD => {
            let (psn, addr, rkey) =
                (r.u32().ok_or_else(bad)?, r.u64().ok_or_else(bad)?, r.u32().ok_or_else(bad)?);
            let add = r.u64().ok_or_else(bad)?;
            r.end().ok_or_else(bad)?;
            Frame::FetchAdd { psn, addr, rkey, add }
        }
        kind::CMP_SWAP => {
            let (psn, addr, rkey) =
                (r.u32().ok_or_else(bad)?, r.u64().ok_or_else(bad)?, r.u32().ok_or_else(bad)?);
            let (compare, swap) = (r.u64().ok_or_else(bad)?, r.u64().ok_or_else(bad)?);
            r.end().ok_or_else(bad)?;
            Frame::CmpSwap { psn, addr, rkey, compare, swap }
        }
        kind::ACK => {
            let (psn, status) = (r.u32().ok_or_else(bad)?, r.u32().ok_or_else(bad)?);
            Frame::Ack { psn, status, data: r.rest() }
        }
        kind::RNR_NAK => {
            let psn = r.u32().ok_or_else(bad)?;
            r.end().ok_or_else(bad)?;
            Frame::RnrNak { psn }
        }
        kind::KEY_REQUEST => {
            let rkey = r.u32().ok_or_else(bad)?;
            r.end().ok_or_else(bad)?;
            Frame::KeyRequest { rkey }
        }
        kind::KEY_GRANT => {
            let (rkey, access) = (r.u32().ok_or_else(bad)?, r.u32().ok_or_else(bad)?);
            let (addr, len, map_len) =
                (r.u64().ok_or_else(bad)?, r.u64().ok_or_else(bad)?, r.u64().ok_or_else(bad)?);
            let (slot, tag, ino) =
                (r.u32().ok_or_else(bad)?, r.u64().ok_or_else(bad)?, r.u64().ok_or_else(bad)?);
            r.end().ok_or_else(bad)?;
            Frame::KeyGrant { rkey, access, addr, len, map_len, slot, tag, ino }
        }
        other => return Err(WireError::UnknownKind(other)),
    };
    Ok(frame)
}

/// Appends the encoding of `f` to `out`.
pub fn encode(f: &Frame, out: &mut Vec<u8>) {
    let data = encode_split(f, out);
    out.extend_from_slice(data);
}

/// Appends the encoding of `f` to `out` except its trailing data, which it returns: the
/// frame on the wire is `out`'s new bytes followed by the returned slice. Lets a writer hand
/// a large payload to the socket without copying it into a frame buffer first.
pub fn encode_split<'f>(f: &'f Frame, out: &mut Vec<u8>) -> &'f [u8] {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(0); // kind, set below
    out.extend_from_slice(&[0; 4]); // length, set below
    let put_imm = |out: &mut Vec<u8>, imm: &Option<u32>| {
        out.push(u8::from(imm.is_some()));
        out.extend_from_slice(&imm.unwrap_or(0).to_le_bytes());
    };
    let mut tail: &[u8] = &[];
    let k = match f {
        Frame::Hello { src_gid, src_qpn, dst_qpn, src_psn, dst_psn, token } => {
            out.extend_from_slice(src_gid);
            out.extend_from_slice(&src_qpn.to_le_bytes());
            out.extend_from_slice(&dst_qpn.to_le_bytes());
            out.extend_from_slice(&src_psn.to_le_bytes());
            out.extend_from_slice(&dst_psn.to_le_bytes());
            out.extend_from_slice(token);
            kind::HELLO
        }
        Frame::HelloAck { status } => {
            out.push(*status);
            kind::HELLO_ACK
        }
        Frame::Write { psn, addr, rkey, imm, data } => {
            out.extend_from_slice(&psn.to_le_bytes());
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&rkey.to_le_bytes());
            put_imm(out, imm);
            tail = data;
            kind::WRITE
        }
        Frame::Read { psn, addr, rkey, len } => {
            out.extend_from_slice(&psn.to_le_bytes());
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&rkey.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            kind::READ
        }
        Frame::Send { psn, imm, data } => {
            out.extend_from_slice(&psn.to_le_bytes());
            put_imm(out, imm);
            tail = data;
            kind::SEND
        }
        Frame::FetchAdd { psn, addr, rkey, add } => {
            out.extend_from_slice(&psn.to_le_bytes());
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&rkey.to_le_bytes());
            out.extend_from_slice(&add.to_le_bytes());
            kind::FETCH_ADD
        }
        Frame::CmpSwap { psn, addr, rkey, compare, swap } => {
            out.extend_from_slice(&psn.to_le_bytes());
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&rkey.to_le_bytes());
            out.extend_from_slice(&compare.to_le_bytes());
            out.extend_from_slice(&swap.to_le_bytes());
            kind::CMP_SWAP
        }
        Frame::Ack { psn, status, data } => {
            out.extend_from_slice(&psn.to_le_bytes());
            out.extend_from_slice(&status.to_le_bytes());
            tail = data;
            kind::ACK
        }
        Frame::RnrNak { psn } => {
            out.extend_from_slice(&psn.to_le_bytes());
            kind::RNR_NAK
        }
        Frame::KeyRequest { rkey } => {
            out.extend_from_slice(&rkey.to_le_bytes());
            kind::KEY_REQUEST
        }
        Frame::KeyGrant { rkey, access, addr, len, map_len, slot, tag, ino } => {
            out.extend_from_slice(&rkey.to_le_bytes());
            out.extend_from_slice(&access.to_le_bytes());
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&map_len.to_le_bytes());
            out.extend_from_slice(&slot.to_le_bytes());
            out.extend_from_slice(&tag.to_le_bytes());
            out.extend_from_slice(&ino.to_le_bytes());
            kind::KEY_GRANT
        }
    };
    let len = (out.len() - start - HEADER + tail.len()) as u32;
    out[start + 3] = k;
    out[start + 4..start + 8].copy_from_slice(&len.to_le_bytes());
    tail
}

/// Checks a header's payload length against its kind, before anything is allocated for
/// it: fixed-size kinds must have exactly their size, data-carrying kinds (write, send,
/// ack) their fixed fields plus at most [`MAX_MESSAGE`] bytes of data.
pub fn check_length(k: u8, len: u32) -> Result<(), WireError> {
    let len_us = len as usize;
    let bad = || WireError::BadLength { kind: k, len: len_us };
    let fixed = match k {
        kind::HELLO => HELLO_LEN,
        kind::HELLO_ACK => 1,
        kind::READ => 4 + 8 + 4 + 4,
        kind::FETCH_ADD => 4 + 8 + 4 + 8,
        kind::CMP_SWAP => 4 + 8 + 4 + 8 + 8,
        kind::RNR_NAK => 4,
        kind::KEY_REQUEST => 4,
        kind::KEY_GRANT => 4 + 4 + 8 + 8 + 8 + 4 + 8 + 8,
        kind::WRITE | kind::SEND | kind::ACK => {
            let fixed = data_offset(k).expect("a data-carrying kind");
            return match len_us.checked_sub(fixed) {
                Some(data) if data <= MAX_MESSAGE as usize => Ok(()),
                _ => Err(bad()),
            };
        }
        other => return Err(WireError::UnknownKind(other)),
    };
    if len_us == fixed { Ok(()) } else { Err(bad()) }
}

/// The kind byte of a `Hello`.
pub const KIND_HELLO: u8 = kind::HELLO;
/// The kind byte of a `HelloAck`.
pub const KIND_HELLO_ACK: u8 = kind::HELLO_ACK;
/// The kind byte of a `Write`.
pub const KIND_WRITE: u8 = kind::WRITE;

/// True for the kinds a requester sends (requests), false for handshake and responses.
pub fn is_request_kind(k: u8) -> bool {
    matches!(k, kind::WRITE | kind::READ | kind::SEND | kind::FETCH_ADD | kind::CMP_SWAP | kind::KEY_REQUEST)
}

/// True for the kinds a responder answers with.
pub fn is_response_kind(k: u8) -> bool {
    matches!(k, kind::ACK | kind::RNR_NAK | kind::KEY_GRANT)
}

/// For a frame kind that ends in variable-length data (write, send, ack), the length of the
/// fixed fields before that data; `None` for the other kinds. A reader can take the fixed
/// part, then read the data straight into the buffer the frame will own
/// ([`decode_payload_split`]).
pub fn data_offset(k: u8) -> Option<usize> {
    match k {
        kind::WRITE => Some(4 + 8 + 4 + 5),
        kind::SEND => Some(4 + 5),
        kind::ACK => Some(4 + 4),
        _ => None,
    }
}

/// Decodes a payload of kind `k` given as its fixed fields (`data_offset(k)` bytes) and its
/// trailing data, which the frame takes without a copy. Same result as [`decode_payload`]
/// over the concatenation.
pub fn decode_payload_split(k: u8, fixed: &[u8], data: Vec<u8>) -> Result<Frame, WireError> {
    let bad = || WireError::BadLength { kind: k, len: fixed.len() + data.len() };
    if data_offset(k) != Some(fixed.len()) {
        return Err(bad());
    }
    let mut frame = decode_payload(k, fixed)?;
    match &mut frame {
        Frame::Write { data: d, .. } | Frame::Send { data: d, .. } | Frame::Ack { data: d, .. } => *d = data,
        _ => return Err(bad()),
    }
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(not(miri))]
    use proptest::prelude::*;

    #[cfg(not(miri))]
    fn frame() -> impl Strategy<Value = Frame> {
        let data = proptest::collection::vec(any::<u8>(), 0..64);
        let imm = proptest::option::of(any::<u32>());
        prop_oneof![
            (any::<[u8; 16]>(), any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>(), any::<[u8; 16]>())
                .prop_map(|(src_gid, src_qpn, dst_qpn, src_psn, dst_psn, token)| Frame::Hello {
                    src_gid,
                    src_qpn,
                    dst_qpn,
                    src_psn,
                    dst_psn,
                    token
                }),
            any::<u8>().prop_map(|status| Frame::HelloAck { status }),
            (any::<u32>(), any::<u64>(), any::<u32>(), imm.clone(), data.clone())
                .prop_map(|(psn, addr, rkey, imm, data)| Frame::Write { psn, addr, rkey, imm, data }),
            (any::<u32>(), any::<u64>(), any::<u32>(), any::<u32>())
                .prop_map(|(psn, addr, rkey, len)| Frame::Read { psn, addr, rkey, len }),
            (any::<u32>(), imm, data.clone()).prop_map(|(psn, imm, data)| Frame::Send { psn, imm, data }),
            (any::<u32>(), any::<u64>(), any::<u32>(), any::<u64>())
                .prop_map(|(psn, addr, rkey, add)| Frame::FetchAdd { psn, addr, rkey, add }),
            (any::<u32>(), any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()).prop_map(
                |(psn, addr, rkey, compare, swap)| Frame::CmpSwap { psn, addr, rkey, compare, swap }
            ),
            (any::<u32>(), any::<u32>(), data).prop_map(|(psn, status, data)| Frame::Ack {
                psn,
                status,
                data
            }),
            any::<u32>().prop_map(|psn| Frame::RnrNak { psn }),
            any::<u32>().prop_map(|rkey| Frame::KeyRequest { rkey }),
            (
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u32>(),
                any::<u64>()
            )
                .prop_map(|(rkey, access, addr, len, map_len, slot, tag)| Frame::KeyGrant {
                    rkey,
                    access,
                    addr,
                    len,
                    map_len,
                    slot,
                    tag,
                    ino: tag ^ 0x5a5a
                }),
        ]
    }

    // Native only: hundreds of cases are slow under Miri, which runs the deterministic
    // tests below; the fuzz target (fuzz/) covers the decoder far more deeply.
    #[cfg(not(miri))]
    proptest! {
        #[test]
        fn round_trips(f in frame()) {
            let mut buf = Vec::new();
            encode(&f, &mut buf);
            let (g, used) = decode(&buf).unwrap();
            prop_assert_eq!(g, f);
            prop_assert_eq!(used, buf.len());
            // Every strict prefix is incomplete, never an error or a panic.
            for cut in 0..buf.len() {
                let is_incomplete = matches!(decode(&buf[..cut]), Err(WireError::Incomplete { .. }));
                prop_assert!(is_incomplete);
            }
        }

        #[test]
        fn split_encoding_and_decoding_agree_with_the_whole(f in frame()) {
            let (mut whole, mut head) = (Vec::new(), Vec::new());
            encode(&f, &mut whole);
            let tail = encode_split(&f, &mut head);
            prop_assert_eq!([head.as_slice(), tail].concat(), whole.clone());
            let (k, len) = decode_header(&head).unwrap();
            prop_assert_eq!(check_length(k, len), Ok(()));
            prop_assert_eq!(len as usize, head.len() + tail.len() - HEADER);
            let g = match data_offset(k) {
                Some(n) => decode_payload_split(k, &head[HEADER..HEADER + n], tail.to_vec()).unwrap(),
                None => decode_payload(k, &head[HEADER..]).unwrap(),
            };
            prop_assert_eq!(g, f);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = decode(&bytes);
        }
    }

    #[test]
    fn every_kind_round_trips() {
        let frames = [
            Frame::Hello { src_gid: [3; 16], src_qpn: 7, dst_qpn: 9, src_psn: 1, dst_psn: 2, token: [4; 16] },
            Frame::HelloAck { status: 1 },
            Frame::Write { psn: 1, addr: 2, rkey: 3, imm: Some(4), data: vec![5; 9] },
            Frame::Read { psn: 1, addr: 2, rkey: 3, len: 4 },
            Frame::Send { psn: 1, imm: None, data: vec![] },
            Frame::FetchAdd { psn: 1, addr: 8, rkey: 3, add: u64::MAX },
            Frame::CmpSwap { psn: 1, addr: 8, rkey: 3, compare: 4, swap: 5 },
            Frame::Ack { psn: 1, status: 10, data: vec![1, 2] },
            Frame::RnrNak { psn: u32::MAX },
            Frame::KeyRequest { rkey: 0xdead_beef },
            Frame::KeyGrant { rkey: 1, access: 2, addr: 3, len: 4, map_len: 8192, slot: 5, tag: 6, ino: 7 },
        ];
        let mut buf = Vec::new();
        for f in &frames {
            encode(f, &mut buf);
        }
        let mut at = 0;
        for f in &frames {
            let (g, used) = decode(&buf[at..]).unwrap();
            assert_eq!(&g, f);
            at += used;
        }
        assert_eq!(at, buf.len());
    }

    #[test]
    fn lengths_are_checked_against_the_kind() {
        // A Hello is exactly HELLO_LEN: a 64 MiB "Hello" is refused from its header.
        assert_eq!(check_length(kind::HELLO, HELLO_LEN as u32), Ok(()));
        assert!(check_length(kind::HELLO, 64 << 20).is_err());
        assert!(check_length(kind::READ, 1 << 20).is_err());
        assert!(check_length(kind::RNR_NAK, 5).is_err());
        assert_eq!(check_length(kind::WRITE, 21), Ok(()));
        assert!(check_length(kind::WRITE, 20).is_err());
        assert_eq!(check_length(kind::WRITE, 21 + MAX_MESSAGE), Ok(()));
        assert!(check_length(kind::WRITE, 22 + MAX_MESSAGE).is_err());
        assert_eq!(check_length(0x63, 0), Err(WireError::UnknownKind(0x63)));
        // Every encoded frame passes its own length check.
        let mut buf = Vec::new();
        encode(&Frame::Ack { psn: 1, status: 0, data: vec![1; 100] }, &mut buf);
        let (k, len) = decode_header(&buf).unwrap();
        assert_eq!(check_length(k, len), Ok(()));
    }

    #[test]
    fn rejects_hostile_headers() {
        assert_eq!(decode(b"XX\x02\x0a\0\0\0\0"), Err(WireError::BadHeader));
        assert_eq!(decode(b"RK\x01\x0a\0\0\0\0"), Err(WireError::BadHeader));
        assert_eq!(decode(b"RK\x02\x0a\xff\xff\xff\xff"), Err(WireError::TooLong(u32::MAX)));
        assert_eq!(decode(b"RK\x02\x63\0\0\0\0"), Err(WireError::UnknownKind(0x63)));
        assert_eq!(decode(b"RK\x02\x0b\x01\0\0\0\0"), Err(WireError::BadLength { kind: 11, len: 1 }));
        // An immediate flag that is neither 0 nor 1.
        let mut buf = Vec::new();
        encode(&Frame::Send { psn: 1, imm: None, data: vec![] }, &mut buf);
        buf[HEADER + 4] = 7;
        assert!(matches!(decode(&buf), Err(WireError::BadLength { .. })));
    }
}
