// A work request with inline data borrows that data until it is posted: it cannot be kept
// (or posted) after the data is gone.
use rdmakit::*;

fn main() -> Result<()> {
    let ctx = Context::open_soft();
    let pd = ctx.alloc_pd()?;
    let dst = pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let wr = {
        let data = vec![1u8; 16];
        SendWr::write_inline(&data, dst.remote().slice(0, 16)?)
    };
    let cq = ctx.create_cq(4)?;
    let qp = pd.create_qp(&cq, &cq, QpCaps::default())?;
    qp.post_send(wr)?;
    Ok(())
}
