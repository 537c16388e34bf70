//! rdmakit's benchmarks through RDMA-Rust's `sideway` crate: the extended QP and CQ (the
//! `ibv_wr_*` post API and `ibv_start_poll`), which the crate says are its faster path.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use rdmakit_peers_bench::{Endpoint, INLINE, Nic, Shape, Wc};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{ExtendedCompletionQueue, PollCompletionQueueError};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{
    ExtendedQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, SetInlineData,
    SetScatterGatherEntry, WorkRequestFlags,
};

struct Sideway {
    ctx: Arc<DeviceContext>,
    cq: Arc<ExtendedCompletionQueue>,
    qp: ExtendedQueuePair,
    /// Registered as `mr`; the NIC reads and writes it, so this side only touches it through
    /// atomics. Dropped after `mr` (field order), which deregisters it first.
    mr: Arc<MemoryRegion>,
    buf: Box<[AtomicU8]>,
    gid: [u8; 16],
    remote: (u64, u32),
    max_inline: u32,
    inline: Vec<u8>,
}

fn err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl Nic for Sideway {
    const CRATE: &'static str = "sideway 0.4.3";
    const HAS_WRITE: bool = true;

    fn open(shape: Shape) -> io::Result<Self> {
        let devices = DeviceList::new().map_err(err)?;
        let dev = devices
            .iter()
            .find(|d| d.name() == shape.device)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no device {}", shape.device)))?;
        let ctx = dev.open().map_err(err)?;
        let pd = ctx.alloc_pd().map_err(err)?;
        let cq = ctx
            .create_cq_builder()
            .setup_cqe(shape.max_send_wr + shape.max_recv_wr)
            .build_ex()
            .map_err(err)?;
        let qp = pd
            .create_qp_builder()
            .setup_max_send_wr(shape.max_send_wr)
            .setup_max_recv_wr(shape.max_recv_wr)
            .setup_max_inline_data(INLINE)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .build_ex()
            .map_err(err)?;
        let buf: Box<[AtomicU8]> = (0..shape.buf_len).map(|_| AtomicU8::new(0)).collect();
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        // SAFETY: `buf` is valid for `buf_len` bytes, is never moved or freed before `mr` is
        // dropped (field order), and is only accessed through atomics while registered.
        let mr = unsafe { pd.reg_mr(buf.as_ptr() as usize, buf.len(), access) }.map_err(err)?;
        let gid = ctx.query_gid(1, shape.gid_index).map_err(err)?.raw;
        Ok(Sideway {
            ctx,
            cq,
            qp,
            mr,
            buf,
            gid,
            remote: (0, 0),
            max_inline: INLINE,
            inline: vec![0; INLINE as usize],
        })
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint {
            qpn: self.qp.qp_number(),
            psn: 0,
            lid: self.ctx.query_port(1).map(|p| p.lid()).unwrap_or(0),
            gid: self.gid,
            addr: self.buf.as_ptr() as u64,
            rkey: self.mr.rkey(),
            len: self.buf.len() as u64,
        }
    }

    fn connect(&mut self, remote: &Endpoint, gid_index: u32) -> io::Result<()> {
        let mtu = self.ctx.query_port(1).map_err(err)?.active_mtu();
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(1)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead);
        self.qp.modify(&a).map_err(err)?;
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(remote.lid).setup_port(1).setup_service_level(0).setup_grh(
            &Gid { raw: remote.gid },
            0,
            gid_index as u8,
            64,
            0,
        );
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        self.qp.modify(&a).map_err(err)?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(0)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(1);
        self.qp.modify(&a).map_err(err)?;
        self.remote = (remote.addr, remote.rkey);
        Ok(())
    }

    fn max_inline(&self) -> u32 {
        self.max_inline
    }

    fn load(&self, off: usize) -> u8 {
        self.buf[off].load(Ordering::Acquire)
    }

    fn store(&mut self, off: usize, v: u8) {
        self.buf[off].store(v, Ordering::Release);
    }

    fn post_write(
        &mut self,
        wr_id: u64,
        off: usize,
        len: u32,
        remote_off: u64,
        inline: bool,
    ) -> io::Result<()> {
        let (addr, rkey) = self.remote;
        let mut guard = self.qp.start_post_send();
        if inline {
            for (i, b) in self.inline[..len as usize].iter_mut().enumerate() {
                *b = self.buf[off + i].load(Ordering::Relaxed);
            }
            guard
                .construct_wr(wr_id, WorkRequestFlags::Signaled | WorkRequestFlags::Inline)
                .setup_write(rkey, addr + remote_off)
                .setup_inline_data(&self.inline[..len as usize]);
        } else {
            let h =
                guard.construct_wr(wr_id, WorkRequestFlags::Signaled).setup_write(rkey, addr + remote_off);
            let local = &self.buf[off..off + len as usize];
            // SAFETY: `local` is inside the registered buffer, which outlives the request.
            unsafe { h.setup_sge(self.mr.lkey(), local.as_ptr() as u64, len) };
        }
        guard.post().map_err(err)
    }

    fn post_send(&mut self, wr_id: u64, off: usize, len: u32, inline: bool) -> io::Result<()> {
        let mut guard = self.qp.start_post_send();
        if inline {
            for (i, b) in self.inline[..len as usize].iter_mut().enumerate() {
                *b = self.buf[off + i].load(Ordering::Relaxed);
            }
            guard
                .construct_wr(wr_id, WorkRequestFlags::Signaled | WorkRequestFlags::Inline)
                .setup_send()
                .setup_inline_data(&self.inline[..len as usize]);
        } else {
            let h = guard.construct_wr(wr_id, WorkRequestFlags::Signaled).setup_send();
            let local = &self.buf[off..off + len as usize];
            // SAFETY: as in post_write.
            unsafe { h.setup_sge(self.mr.lkey(), local.as_ptr() as u64, len) };
        }
        guard.post().map_err(err)
    }

    fn post_recv(&mut self, wr_id: u64, off: usize, len: u32) -> io::Result<()> {
        let mut guard = self.qp.start_post_recv();
        let local = &self.buf[off..off + len as usize];
        // SAFETY: as in post_write.
        unsafe { guard.construct_wr(wr_id).setup_sge(self.mr.lkey(), local.as_ptr() as u64, len) };
        guard.post().map_err(err)
    }

    fn poll(&mut self, out: &mut [Wc]) -> io::Result<usize> {
        let poller = match self.cq.start_poll() {
            Ok(p) => p,
            Err(PollCompletionQueueError::CompletionQueueEmpty) => return Ok(0),
            Err(e) => return Err(err(e)),
        };
        let mut n = 0;
        for (o, wc) in out.iter_mut().zip(poller) {
            *o = Wc { wr_id: wc.wr_id(), ok: wc.status() == 0, status: wc.status() };
            n += 1;
        }
        Ok(n)
    }
}

fn main() -> std::process::ExitCode {
    rdmakit_peers_bench::main::<Sideway>()
}
