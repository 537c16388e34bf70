// The NIC (or a peer) may write a registered region at any time: a `&[u8]` over it is only
// available through an `unsafe fn` whose contract the caller promises.
use rdmakit::*;

fn main() -> Result<()> {
    let pd = Context::open_soft().alloc_pd()?;
    let mr = pd.alloc_mr(64, AccessFlags::ALL_REMOTE)?;
    let bytes: &[u8] = mr.as_slice().expect("host memory");
    println!("{}", bytes[0]);
    Ok(())
}
