//! The packed key a host hands to its DPU: what the DPU needs to create an alias.

/// A host memory key opened to other vHCAs, as the host ships it to the DPU (over any
/// channel the two already share).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PackedKey {
    /// The host's mkey number.
    pub mkey: u32,
    /// The host function's vHCA id (GVMI).
    pub vhca_id: u32,
    /// The incarnation of the key: changes whenever the host creates a key, even if the
    /// device hands out a number used before. Constant across the re-binds of a pool key, so
    /// the DPU's cached alias of it keeps serving.
    pub uuid: u64,
    /// The incarnation of this export: fresh at every bind and increasing across the whole
    /// host and its reboots (its boot time plus its monotonic clock), so the DPU refuses an
    /// export of a key that the host has since re-bound to another buffer, or destroyed and
    /// re-created under the same number (see [`AliasCache::import`](super::AliasCache::import)).
    pub export_gen: u64,
    /// Address of the region's first byte through this key (0: pool keys are zero-based).
    pub addr: u64,
    /// Length of the region in bytes.
    pub len: u64,
    /// True for a key of the host's UMR pool (the DPU caches its alias), false for a plain
    /// key made for this export alone.
    pub pooled: bool,
    /// The secret the host opened the key with; the alias must present it.
    pub access_key: [u8; 32],
}

/// Why bytes are not a packed key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PackedKeyError {
    /// Not [`PackedKey::ENCODED_LEN`] bytes.
    #[error("a packed key is {expected} bytes, got {got}")]
    Length {
        /// Bytes expected.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// Unknown format version.
    #[error("packed key version {0} is not supported (expected 2)")]
    Version(u8),
    /// The pooled flag is neither 0 nor 1.
    #[error("packed key flag byte {0:#x} is invalid")]
    Flags(u8),
}

impl PackedKey {
    /// Encoded length: version, flags, mkey, vhca_id, uuid, export_gen, addr, len, access key.
    pub const ENCODED_LEN: usize = 1 + 1 + 4 + 4 + 8 + 8 + 8 + 8 + 32;

    /// The encoding's version byte (2: with `export_gen`).
    pub const VERSION: u8 = 2;

    /// The alias map's key: `(vhca_id << 32) | mkey`, as UCX's cross-GVMI hash map.
    pub fn map_key(&self) -> u64 {
        (u64::from(self.vhca_id) << 32) | u64::from(self.mkey)
    }

    /// Little-endian encoding.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[0] = Self::VERSION;
        out[1] = u8::from(self.pooled);
        out[2..6].copy_from_slice(&self.mkey.to_le_bytes());
        out[6..10].copy_from_slice(&self.vhca_id.to_le_bytes());
        out[10..18].copy_from_slice(&self.uuid.to_le_bytes());
        out[18..26].copy_from_slice(&self.export_gen.to_le_bytes());
        out[26..34].copy_from_slice(&self.addr.to_le_bytes());
        out[34..42].copy_from_slice(&self.len.to_le_bytes());
        out[42..74].copy_from_slice(&self.access_key);
        out
    }

    /// Decodes [`encode`](Self::encode)'s output; anything else is an error, never a panic.
    pub fn decode(b: &[u8]) -> Result<PackedKey, PackedKeyError> {
        let b: &[u8; Self::ENCODED_LEN] =
            b.try_into().map_err(|_| PackedKeyError::Length { expected: Self::ENCODED_LEN, got: b.len() })?;
        if b[0] != Self::VERSION {
            return Err(PackedKeyError::Version(b[0]));
        }
        let pooled = match b[1] {
            0 => false,
            1 => true,
            f => return Err(PackedKeyError::Flags(f)),
        };
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from(u32_at(i)) | (u64::from(u32_at(i + 4)) << 32);
        let mut access_key = [0u8; 32];
        access_key.copy_from_slice(&b[42..74]);
        Ok(PackedKey {
            mkey: u32_at(2),
            vhca_id: u32_at(6),
            uuid: u64_at(10),
            export_gen: u64_at(18),
            addr: u64_at(26),
            len: u64_at(34),
            pooled,
            access_key,
        })
    }
}
