//! rdmakit's benchmarks through jonhoo's `ibverbs` crate. It posts sends and receives only
//! (no RDMA write, no inline data), so only `send-lat` and `send-bw` run through it.

use std::io;

use ibverbs::{
    CompletionQueue, Context, MemoryRegion, PreparedQueuePair, ProtectionDomain, QueuePair, ibv_qp_type,
    ibv_wc,
};
use rdmakit_peers_bench::{Endpoint, Nic, Shape, Wc};

struct Ibverbs {
    cq: &'static CompletionQueue<'static>,
    prepared: Option<PreparedQueuePair<'static>>,
    qp: Option<QueuePair<'static>>,
    mr: MemoryRegion<u8>,
    wcs: Vec<ibv_wc>,
}

fn no_qp() -> io::Error {
    io::Error::other("the QP is not connected yet")
}

impl Nic for Ibverbs {
    const CRATE: &'static str = "ibverbs 0.9.2";
    const HAS_WRITE: bool = false;

    fn open(shape: Shape) -> io::Result<Self> {
        let devices = ibverbs::devices()?;
        let dev = devices
            .iter()
            .find(|d| d.name().is_some_and(|n| n.to_bytes() == shape.device.as_bytes()))
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no device {}", shape.device)))?;
        // The crate's objects borrow each other (QP -> PD, CQ -> context); this process keeps
        // them until it exits, so they are leaked to get a 'static borrow.
        let ctx: &'static Context = Box::leak(Box::new(dev.open()?));
        let cq: &'static CompletionQueue<'static> =
            Box::leak(Box::new(ctx.create_cq((shape.max_send_wr + shape.max_recv_wr) as i32, 0)?));
        let pd: &'static ProtectionDomain<'static> = Box::leak(Box::new(ctx.alloc_pd()?));
        let mr = pd.allocate::<u8>(shape.buf_len)?;
        let prepared = pd
            .create_qp(cq, cq, ibv_qp_type::IBV_QPT_RC)
            .set_gid_index(shape.gid_index)
            .allow_remote_rw()
            .set_max_send_wr(shape.max_send_wr)
            .set_max_recv_wr(shape.max_recv_wr)
            .build()?;
        Ok(Ibverbs { cq, prepared: Some(prepared), qp: None, mr, wcs: vec![ibv_wc::default(); 16] })
    }

    fn endpoint(&self) -> Endpoint {
        let e = self.prepared.as_ref().map(|p| p.endpoint());
        let mut gid = [0u8; 16];
        if let Some(g) = e.and_then(|e| e.gid) {
            gid[..8].copy_from_slice(&g.subnet_prefix().to_be_bytes());
            gid[8..].copy_from_slice(&g.interface_id().to_be_bytes());
        }
        Endpoint {
            qpn: e.map_or(0, |e| e.num),
            psn: 0, // the crate always starts at PSN 0
            lid: e.map_or(0, |e| e.lid),
            gid,
            addr: self.mr.as_ptr() as u64,
            rkey: self.mr.rkey().key,
            len: self.mr.len() as u64,
        }
    }

    fn connect(&mut self, remote: &Endpoint, _gid_index: u32) -> io::Result<()> {
        let prepared = self.prepared.take().ok_or_else(no_qp)?;
        let mut theirs = prepared.endpoint();
        theirs.num = remote.qpn;
        theirs.lid = remote.lid;
        theirs.gid = Some(ibverbs_sys::ibv_gid { raw: remote.gid }.into());
        self.qp = Some(prepared.handshake(theirs)?);
        Ok(())
    }

    fn max_inline(&self) -> u32 {
        0
    }

    fn load(&self, off: usize) -> u8 {
        let byte: &u8 = &self.mr[off];
        // SAFETY: `byte` is a valid, aligned u8 of the buffer; a volatile read so that a spin
        // loop sees what the NIC writes (the crate hands out the buffer only as a slice).
        unsafe { std::ptr::read_volatile(byte) }
    }

    fn store(&mut self, off: usize, v: u8) {
        self.mr[off] = v;
    }

    fn post_write(&mut self, _: u64, _: usize, _: u32, _: u64, _: bool) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "ibverbs has no RDMA write"))
    }

    fn post_send(&mut self, wr_id: u64, off: usize, len: u32, _inline: bool) -> io::Result<()> {
        let qp = self.qp.as_mut().ok_or_else(no_qp)?;
        // SAFETY: the buffer lives as long as this struct, which outlives every request (the
        // run reaps each completion before it ends), and is never reallocated.
        unsafe { qp.post_send(&mut self.mr, off..off + len as usize, wr_id) }
    }

    fn post_recv(&mut self, wr_id: u64, off: usize, len: u32) -> io::Result<()> {
        let qp = self.qp.as_mut().ok_or_else(no_qp)?;
        // SAFETY: as in post_send.
        unsafe { qp.post_receive(&mut self.mr, off..off + len as usize, wr_id) }
    }

    fn poll(&mut self, out: &mut [Wc]) -> io::Result<usize> {
        let n = out.len().min(self.wcs.len());
        let got = self.cq.poll(&mut self.wcs[..n])?;
        for (o, wc) in out.iter_mut().zip(got.iter()) {
            *o = Wc { wr_id: wc.wr_id(), ok: wc.is_valid(), status: wc.error().map_or(0, |(s, _)| s as u32) };
        }
        Ok(got.len())
    }
}

fn main() -> std::process::ExitCode {
    rdmakit_peers_bench::main::<Ibverbs>()
}
