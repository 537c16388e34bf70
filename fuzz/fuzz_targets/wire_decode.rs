//! Fuzz target for the soft NIC's wire decoder (`rdmakit_verbs::soft::wire`).
//!
//! The decoder is documented as total: any byte string gives a frame or a `WireError`,
//! never a panic. Beyond "no panic", this checks:
//! - consuming a stream frame by frame: each `decode` reports a length within the buffer
//!   that matches the frame header, and an error stops the stream;
//! - round trip: every decoded frame re-encodes to bytes of the same length that decode
//!   to the same frame, and every strict prefix of that encoding is `Incomplete`;
//! - `decode_header` agrees with `decode` on the kind and length;
//! - `decode_payload` on arbitrary (kind, payload) pairs is total and round-trips too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmakit_verbs::soft::wire::{self, Frame, WireError};

/// Encodes `f`, checks the encoding decodes to `f` and that its prefixes are incomplete.
fn check_round_trip(f: &Frame) -> Vec<u8> {
    let mut enc = Vec::new();
    wire::encode(f, &mut enc);
    let (g, used) = wire::decode(&enc).unwrap_or_else(|e| panic!("encoding of {f:?} does not decode: {e}"));
    assert_eq!(&g, f, "round trip changed the frame");
    assert_eq!(used, enc.len(), "decode of an encoding used {used} of {} bytes", enc.len());
    // Appending bytes must not change what the first frame decodes to.
    let mut longer = enc.clone();
    longer.extend_from_slice(b"RK\x01");
    assert_eq!(wire::decode(&longer), Ok((g, used)));
    // Strict prefixes (a few: header cuts and the last byte) are Incomplete.
    for cut in (0..enc.len().min(wire::HEADER + 1)).chain(enc.len().checked_sub(1)) {
        match wire::decode(&enc[..cut]) {
            Err(WireError::Incomplete { need }) => assert!(need > 0 && cut + need <= enc.len()),
            other => panic!("prefix {cut}/{} of {f:?} gave {other:?}", enc.len()),
        }
    }
    enc
}

fuzz_target!(|data: &[u8]| {
    // A stream of frames, consumed until an error (or incomplete tail).
    let mut rest = data;
    loop {
        match wire::decode(rest) {
            Ok((f, used)) => {
                assert!(used >= wire::HEADER && used <= rest.len(), "used {used} of {}", rest.len());
                let (k, len) = wire::decode_header(rest).expect("decode succeeded, so the header is valid");
                assert_eq!(used, wire::HEADER + len as usize);
                let enc = check_round_trip(&f);
                assert_eq!(enc.len(), used, "re-encoding {f:?} changed its length");
                assert_eq!(enc[3], k, "re-encoding {f:?} changed its kind");
                rest = &rest[used..];
            }
            Err(WireError::Incomplete { need }) => {
                assert!(need > 0);
                break;
            }
            Err(_) => break,
        }
    }

    // The payload decoder alone: first byte is the kind, the rest the payload.
    if let Some((&k, p)) = data.split_first() {
        if let Ok(f) = wire::decode_payload(k, p) {
            let enc = check_round_trip(&f);
            assert_eq!(enc.len(), wire::HEADER + p.len());
            assert_eq!(enc[3], k);
        }
    }
});
