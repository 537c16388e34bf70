//! Devices: listing, opening (by name, by provider, or the environment's choice).

use std::sync::Arc;

use crate::cq::CompletionQueue;
use crate::dm::DeviceMemory;
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::soft::{self, SoftConfig, SoftDevice};
use crate::types::{DeviceAttr, GidEntry, GidKind, ProviderKind};

/// Environment variable choosing the provider: `soft`, `verbs` or `auto` (default).
pub const PROVIDER_ENV: &str = "RDMAKIT_PROVIDER";
/// Environment variable naming the device to open (e.g. `mlx5_0`, `rxe0`, `soft0`).
pub const DEVICE_ENV: &str = "RDMAKIT_DEVICE";

/// A device that can be opened.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
    /// Provider behind it.
    pub provider: ProviderKind,
}

/// Why the rdma-core provider is not compiled into this build (empty when it is): the
/// `verbs` feature was off, or rdma-core's development files or libclang were missing at build
/// time, with the packages to install.
pub const VERBS_MISSING: &str = env!("RDMAKIT_VERBS_MISSING");

/// Whether the rdma-core provider is compiled into this build.
pub const VERBS_BUILT: bool = cfg!(rdmakit_verbs);

/// Lists the devices of both providers: every verbs device rdma-core reports (none on a
/// machine without RDMA support: that is not an error) and the soft NIC's `soft0`.
pub fn devices() -> Vec<DeviceInfo> {
    CtxBackend::verbs_device_names()
        .unwrap_or_default()
        .into_iter()
        .map(|name| DeviceInfo { name, provider: ProviderKind::Verbs })
        .chain(std::iter::once(DeviceInfo { name: soft::DEFAULT_NAME.into(), provider: ProviderKind::Soft }))
        .collect()
}

/// Why no verbs device can be used here, or `None` if at least one exists.
///
/// Tests and tools print this when they skip the verbs provider.
pub fn verbs_unavailable_reason() -> Option<String> {
    match CtxBackend::verbs_device_names() {
        Ok(names) if !names.is_empty() => None,
        Ok(_) => Some("rdma-core reports no verbs devices".into()),
        Err(reason) => Some(reason),
    }
}

/// An open device: the root of every other object (`struct ibv_context`).
///
/// Cloning is cheap (an `Arc`). Children keep their parent alive, so objects can be dropped
/// in any order.
///
/// # Examples
/// ```
/// use rdmakit_verbs::{Context, ProviderKind};
/// let ctx = Context::open_soft();
/// assert_eq!(ctx.provider(), ProviderKind::Soft);
/// println!("{} can hold {} bytes of device memory", ctx.name(), ctx.attr().max_dm_size);
/// ```
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

pub(crate) struct ContextInner {
    pub(crate) backend: CtxBackend,
    pub(crate) attr: DeviceAttr,
}

pub(crate) enum CtxBackend {
    Soft(Arc<SoftDevice>),
    #[cfg(rdmakit_verbs)]
    Verbs(crate::rdma::Context),
}

/// The one place a device dispatches to its provider.
impl CtxBackend {
    /// The names of the verbs devices, or why none can be listed (for a person).
    fn verbs_device_names() -> std::result::Result<Vec<String>, String> {
        #[cfg(rdmakit_verbs)]
        {
            crate::rdma::device_names().map_err(|e| e.to_string())
        }
        #[cfg(not(rdmakit_verbs))]
        {
            Err(format!("the rdma-core provider is not built in: {VERBS_MISSING}"))
        }
    }

    /// Opens a verbs device by name, or the first one, with its attributes.
    fn open_verbs(name: Option<&str>) -> Result<(CtxBackend, DeviceAttr)> {
        #[cfg(rdmakit_verbs)]
        {
            let ctx = crate::rdma::Context::open(name)?;
            let attr = ctx.query()?;
            Ok((CtxBackend::Verbs(ctx), attr))
        }
        #[cfg(not(rdmakit_verbs))]
        {
            let _ = name;
            Err(Error::ProviderUnavailable { provider: "verbs", reason: VERBS_MISSING })
        }
    }

    /// The soft NIC device, if this is one.
    pub(crate) fn soft(&self) -> Option<&Arc<SoftDevice>> {
        match self {
            CtxBackend::Soft(dev) => Some(dev),
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(_) => None,
        }
    }

    fn gid(&self, port_num: u8, explicit: Option<u8>) -> Result<GidEntry> {
        match self {
            CtxBackend::Soft(dev) => {
                // One port, one address: the soft NIC has no GID table to choose from.
                let _ = (port_num, explicit);
                Ok(GidEntry { index: 0, gid: dev.gid(), kind: Some(GidKind::Soft) })
            }
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(ctx) => ctx.gid(port_num, explicit),
        }
    }

    /// This function's vHCA id (`crate::mlx5`).
    pub(crate) fn vhca_id(&self) -> Result<u32> {
        match self {
            CtxBackend::Soft(dev) => Ok(dev.vhca_id()),
            #[cfg(rdmakit_verbs)]
            CtxBackend::Verbs(vctx) => vctx.vhca_id(),
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.inner.attr.name)
            .field("provider", &self.inner.attr.provider)
            .finish()
    }
}

impl Context {
    /// Opens the device the environment asks for.
    ///
    /// `RDMAKIT_PROVIDER=soft` opens the soft NIC; `verbs` opens a verbs device (an error
    /// if there is none); unset or `auto` opens a verbs device if one exists, else the soft
    /// NIC. `RDMAKIT_DEVICE` names the device.
    pub fn open_default() -> Result<Context> {
        let provider = std::env::var(PROVIDER_ENV).unwrap_or_default();
        let device = std::env::var(DEVICE_ENV).ok().filter(|d| !d.is_empty());
        match provider.as_str() {
            "soft" => match device {
                Some(name) => Context::open(&name),
                None => Ok(Context::open_soft()),
            },
            "verbs" => Context::open_verbs(device.as_deref()),
            "" | "auto" => {
                if let Some(name) = device {
                    return Context::open(&name);
                }
                match Context::open_verbs(None) {
                    Err(e @ (Error::NoDevice { .. } | Error::ProviderUnavailable { .. })) => {
                        tracing::debug!(reason = %e, "no verbs device; using the soft NIC");
                        Ok(Context::open_soft())
                    }
                    other => other,
                }
            }
            other => Err(Error::InvalidArgument(format!(
                "{PROVIDER_ENV}={other:?}: expected `soft`, `verbs` or `auto`"
            ))),
        }
    }

    /// Opens a device by name: `soft0` is the soft NIC, anything else a verbs device.
    pub fn open(name: &str) -> Result<Context> {
        if name == soft::DEFAULT_NAME {
            return Ok(Context::open_soft());
        }
        Context::open_verbs(Some(name))
    }

    /// Opens the process-wide soft NIC `soft0` (default [`SoftConfig`]).
    pub fn open_soft() -> Context {
        Context::from_soft(SoftDevice::default_device())
    }

    /// Creates a new, independent soft NIC device with its own settings (for example a
    /// different device-memory capacity). It can connect to every other soft device in
    /// the process.
    pub fn open_soft_with(config: SoftConfig) -> Result<Context> {
        Ok(Context::from_soft(SoftDevice::new_device(config)?))
    }

    pub(crate) fn from_soft_device(dev: Arc<SoftDevice>) -> Context {
        Context::from_soft(dev)
    }

    fn from_soft(dev: Arc<SoftDevice>) -> Context {
        let attr = dev.attr();
        Context { inner: Arc::new(ContextInner { backend: CtxBackend::Soft(dev), attr }) }
    }

    /// Opens a verbs device by name, or the first one.
    pub fn open_verbs(name: Option<&str>) -> Result<Context> {
        let (backend, attr) = CtxBackend::open_verbs(name)?;
        Ok(Context { inner: Arc::new(ContextInner { backend, attr }) })
    }

    /// The device's attributes.
    pub fn attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.inner.attr.name
    }

    /// Which provider runs this device.
    pub fn provider(&self) -> ProviderKind {
        self.inner.attr.provider
    }

    /// The GID table entry that connections on `port_num` use when [`ConnectOptions::gid_index`](crate::ConnectOptions::gid_index)
    /// is `explicit` (`None`: chosen by type, RoCE v2 first; see its docs). On the soft NIC
    /// this is its own address, of kind [`GidKind::Soft`].
    ///
    /// ```
    /// let ctx = rdmakit_verbs::Context::open_soft();
    /// let gid = ctx.gid(1, None)?;
    /// assert_eq!(gid.kind, Some(rdmakit_verbs::GidKind::Soft));
    /// # Ok::<(), rdmakit_verbs::Error>(())
    /// ```
    pub fn gid(&self, port_num: u8, explicit: Option<u8>) -> Result<GidEntry> {
        self.inner.backend.gid(port_num, explicit)
    }

    /// The provider object behind this device.
    pub(crate) fn backend(&self) -> &CtxBackend {
        &self.inner.backend
    }

    /// True if `other` is a handle of this same open device.
    pub(crate) fn same_device(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Allocates a protection domain (`ibv_alloc_pd`).
    #[doc(alias = "ibv_alloc_pd")]
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        ProtectionDomain::new(self)
    }

    /// Creates a completion queue with room for at least `cqe` completions
    /// (`ibv_create_cq`, with a completion channel for async waiting).
    #[doc(alias = "ibv_create_cq")]
    pub fn create_cq(&self, cqe: u32) -> Result<CompletionQueue> {
        CompletionQueue::new(self, cqe)
    }

    /// Allocates `len` bytes of device memory (`ibv_alloc_dm`). Fails cleanly with
    /// [`Error::DeviceMemoryExhausted`] or [`Error::Unsupported`] when the device has too
    /// little or none (rxe has none).
    #[doc(alias = "ibv_alloc_dm")]
    pub fn alloc_dm(&self, len: u64) -> Result<DeviceMemory> {
        DeviceMemory::new(self, len)
    }
}
