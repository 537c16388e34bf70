// `rwrite` takes the local slice for as long as the NIC may read it and hands it back with
// the result (`BufResult`): the caller cannot use it while the write is in flight.
use rdmakit::channel::Pipe;
use rdmakit::*;

async fn send(pipe: &Pipe, mr: &MemoryRegion) -> Result<()> {
    let slice = mr.slice(0, 8)?;
    let write = pipe.rwrite(slice);
    let again = slice.len();
    let (r, _slice) = write.await;
    r.map_err(|e| Error::InvalidArgument(e.to_string()))?;
    println!("{again}");
    Ok(())
}

fn main() {
    let _ = send;
}
