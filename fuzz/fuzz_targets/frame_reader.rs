//! Fuzz target for the soft NIC's production frame reader (`tcp::read_frame`, reached
//! through `rdmakit_verbs::soft::fuzz_read_frames`): the same code that reads every frame
//! off a socket, including the split payload path (a data-carrying frame's fixed fields
//! into the scratch buffer, then its data straight into the vector the frame keeps), read
//! through a 7-byte buffer so frames straddle refills; and the responder's discarding
//! reader (`read_frame_with`), whose data limit is computed from the fixed fields and whose
//! over-limit data is consumed without being stored.
//!
//! Beyond "no panic", this checks that every frame the reader returns
//! - passes the length check of its kind (what the reader must enforce before allocating),
//! - re-encodes to a frame `wire::decode` reads back to the same frame;
//!
//! and that the reader never returns more frames than the input could hold (each costs at
//! least a header).
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmakit_verbs::soft::{fuzz_read_frames, wire};

fuzz_target!(|data: &[u8]| {
    let frames = fuzz_read_frames(data);
    // Four passes (one per reader mode, and the responder's discarding reader), each at most
    // one frame per header's worth of input plus one error.
    assert!(frames.len() <= 4 * (data.len() / wire::HEADER + 1), "{} frames from {} bytes", frames.len(), data.len());
    for f in frames.into_iter().flatten() {
        let mut enc = Vec::new();
        wire::encode(&f, &mut enc);
        let (k, len) = wire::decode_header(&enc).expect("an encoded header");
        assert_eq!(wire::check_length(k, len), Ok(()), "{f:?} passed the reader but not its length check");
        let (g, used) = wire::decode(&enc).expect("an encoded frame decodes");
        assert_eq!(used, enc.len());
        assert_eq!(g, f, "the reader and the decoder disagree");
        assert!(enc.len() <= data.len(), "a frame longer than the input");
    }
});
