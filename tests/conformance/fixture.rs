//! Shared set-up for conformance cases: opening the provider, connected QP pairs, waiting.

use std::time::Duration;

use libtest_mimic::Failed;
use rdmakit::*;

/// How long a case waits for one completion before failing (rxe under TCG is slow).
pub const WAIT: Duration = Duration::from_secs(20);

/// What a case needs from the device beyond the basics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Needs {
    Nothing,
    DeviceMemory,
    /// An IP address of the device for connection management (rdma_cm on verbs).
    CmAddress,
    /// mlx5's indirect keys and UMR (mlx5dv on verbs; the soft NIC emulates them).
    Mlx5,
    /// A verbs device without mlx5dv, where the mlx5 calls must be clean refusals.
    NotMlx5,
}

/// The IP to listen on for connection cases: loopback on the soft NIC; on verbs an address
/// of the device, from `RDMAKIT_CM_IP` or the rxe VM's `RDMAKIT_RXE_IP` (rdma_cm does not
/// work over `lo` with rxe).
pub fn cm_ip(provider: ProviderKind) -> Option<std::net::IpAddr> {
    match provider {
        ProviderKind::Soft => Some(std::net::Ipv4Addr::LOCALHOST.into()),
        ProviderKind::Verbs => ["RDMAKIT_CM_IP", "RDMAKIT_RXE_IP"]
            .iter()
            .find_map(|v| std::env::var(v).ok().and_then(|s| s.parse().ok())),
    }
}

pub fn verbs_skip_reason() -> Option<String> {
    rdmakit::verbs_unavailable_reason()
}

/// Why `provider` cannot run a case that needs `needs`, if it cannot.
pub fn requirement_unmet(provider: ProviderKind, needs: Needs) -> Option<String> {
    match needs {
        Needs::Nothing => None,
        Needs::DeviceMemory => {
            let ctx = open(provider).ok()?;
            (ctx.attr().max_dm_size == 0)
                .then(|| format!("{} has no device memory (max_dm_size = 0)", ctx.name()))
        }
        Needs::CmAddress => cm_ip(provider)
            .is_none()
            .then(|| "no IP address for rdma_cm: set RDMAKIT_CM_IP to an address of the device".into()),
        Needs::Mlx5 => match provider {
            ProviderKind::Soft => None,
            ProviderKind::Verbs => mlx5_refusal(provider).map(|why| format!("not an mlx5 device: {why}")),
        },
        Needs::NotMlx5 => match provider {
            ProviderKind::Soft => Some("the soft NIC emulates mlx5's indirect keys and UMR".into()),
            ProviderKind::Verbs => {
                mlx5_refusal(provider).is_none().then(|| "an mlx5 device: the mlx5 cases run instead".into())
            }
        },
    }
}

/// Why the device refuses an mlx5 indirect key (`Unsupported`: not mlx5), if it does.
fn mlx5_refusal(provider: ProviderKind) -> Option<String> {
    let ctx = open(provider).ok()?;
    let pd = ctx.alloc_pd().ok()?;
    match pd.create_indirect_mkey(0, 4096, AccessFlags::ALL_REMOTE) {
        Err(Error::Unsupported(why)) => Some(format!("{}: {why}", ctx.name())),
        _ => None,
    }
}

fn open(provider: ProviderKind) -> Result<Context> {
    match provider {
        ProviderKind::Soft => Ok(Context::open_soft()),
        ProviderKind::Verbs => {
            let dev = std::env::var(DEVICE_ENV).ok().filter(|d| !d.is_empty() && !d.starts_with("soft"));
            Context::open_verbs(dev.as_deref())
        }
    }
}

/// One case's view of its provider.
pub struct Env {
    pub provider: ProviderKind,
    pub ctx: Context,
}

impl Env {
    pub fn new(provider: ProviderKind) -> Result<Env, Failed> {
        let ctx = open(provider).map_err(|e| format!("opening the {provider} provider: {e}"))?;
        Ok(Env { provider, ctx })
    }

    /// Connection options: defaults, with the GID index from the environment.
    pub fn opts(&self) -> ConnectOptions {
        let gid_index = std::env::var("RDMAKIT_GID_INDEX").ok().and_then(|v| v.parse().ok());
        ConnectOptions::default().with_gid_index(gid_index)
    }

    pub fn pair(&self) -> Result<Pair, Failed> {
        self.pair_with(QpCaps::default(), 256, self.opts())
    }

    /// Two connected QPs on one device, each with its own CQ.
    pub fn pair_with(&self, caps: QpCaps, cqe: u32, opts: ConnectOptions) -> Result<Pair, Failed> {
        let pd = self.ctx.alloc_pd()?;
        let cq_a = self.ctx.create_cq(cqe)?;
        let cq_b = self.ctx.create_cq(cqe)?;
        let a = pd.create_qp(&cq_a, &cq_a, caps)?;
        let b = pd.create_qp(&cq_b, &cq_b, caps)?;
        let (ea, eb) = (a.address_with(&opts)?, b.address_with(&opts)?);
        a.connect(&eb, &opts)?;
        b.connect(&ea, &opts)?;
        Ok(Pair { pd, cq_a, cq_b, a, b })
    }
}

pub struct Pair {
    pub pd: ProtectionDomain,
    pub cq_a: CompletionQueue,
    pub cq_b: CompletionQueue,
    pub a: QueuePair,
    pub b: QueuePair,
}

/// Waits for one completion on `cq`, failing the case after [`WAIT`].
pub fn wait(cq: &CompletionQueue) -> Result<WorkCompletion, Failed> {
    cq.wait(Some(WAIT)).map_err(|e| format!("waiting for a completion: {e}").into())
}

/// Waits for one successful completion.
pub fn wait_ok(cq: &CompletionQueue) -> Result<WorkCompletion, Failed> {
    Ok(wait(cq)?.ok()?)
}

/// A deterministic byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8)).collect()
}

/// `ensure!`-style check returning a test failure.
#[macro_export]
macro_rules! check {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+).into());
        }
    };
}

/// Checks equality with a useful message.
#[macro_export]
macro_rules! check_eq {
    ($a:expr, $b:expr) => {{
        let (a, b) = (&$a, &$b);
        if a != b {
            return Err(
                format!("{} = {:?}, expected {:?} ({}:{})", stringify!($a), a, b, file!(), line!()).into()
            );
        }
    }};
}

/// A conformance case: its name, what it needs of the device, and its body.
/// The body of a case.
pub type CaseFn = fn(&Env) -> Result<(), Failed>;

pub struct Case {
    pub name: &'static str,
    pub needs: Needs,
    pub run: CaseFn,
}

pub const fn case(name: &'static str, run: CaseFn) -> Case {
    Case { name, needs: Needs::Nothing, run }
}
