//! The answer to the CUDA runtime's integrity check (export table `d4082055-…`).
//!
//! cudart (linked statically into every nvcc-built program) asks the driver, before its first
//! allocation, for a 16-byte token over facts both sides know, and compares it with its own;
//! a driver that answers wrongly sees `cudaMalloc` fail. What the token is was established by
//! ZLUDA's reverse engineering (its `dark_api` crate): HMAC (RFC 2104) over MD2 (RFC 1319),
//! with the fixed key [`KEY`], of a [`Record`] followed by one [`DeviceIdentity`] per device;
//! runtime versions ending in 0 or 1 get the fixed answers of [`fixed_answer`]. Those are the
//! facts used here; HMAC and MD2 come from RustCrypto's crates, the rest is this project's.
//!
//! Pure logic: the C entry point gathering the inputs is in `export.rs`.

use hmac::{Hmac, KeyInit, Mac};
use md2::Md2;

/// The HMAC key cudart and the driver share.
const KEY: [u8; 16] = [
    0x14, 0x6a, 0xdd, 0xae, 0x53, 0xa9, 0xa7, 0x52, 0xaa, 0x08, 0x41, 0x36, 0x0b, 0xf5, 0x5a, 0x9f,
];

/// What the check covers about the process and the driver, hashed in this order with the
/// host's byte order (x86-64: little endian), 48 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// What `cuDriverGetVersion` answers.
    pub driver_version: u32,
    /// The version cudart passes to the check.
    pub runtime_version: u32,
    /// `getpid()`.
    pub process: u32,
    /// The low 32 bits of the calling thread's `pthread_self()`.
    pub thread: u32,
    /// Address of the cudart interface table (`6bd5fb6c-…`) as `cuGetExportTable` gave it.
    pub cudart_table: u64,
    /// Address of the integrity-check table itself.
    pub integrity_table: u64,
    /// Address of the check's function (the table's slot 1).
    pub check_function: u64,
    /// The time cudart passes to the check.
    pub unix_seconds: u64,
}

impl Record {
    fn bytes(&self) -> [u8; 48] {
        let mut b = [0u8; 48];
        let words32 = [
            self.driver_version,
            self.runtime_version,
            self.process,
            self.thread,
        ];
        for (i, w) in words32.iter().enumerate() {
            b[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
        }
        let words64 = [
            self.cudart_table,
            self.integrity_table,
            self.check_function,
            self.unix_seconds,
        ];
        for (i, w) in words64.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&w.to_ne_bytes());
        }
        b
    }
}

/// One device as the check sees it: what `cuDeviceGetUuid_v2` and the PCI domain, bus and
/// device attributes answer, 28 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIdentity {
    pub uuid: [u8; 16],
    pub pci_domain: i32,
    pub pci_bus: i32,
    pub pci_device: i32,
}

impl DeviceIdentity {
    fn bytes(&self) -> [u8; 28] {
        let mut b = [0u8; 28];
        b[..16].copy_from_slice(&self.uuid);
        for (i, w) in [self.pci_domain, self.pci_bus, self.pci_device]
            .iter()
            .enumerate()
        {
            b[16 + 4 * i..20 + 4 * i].copy_from_slice(&w.to_ne_bytes());
        }
        b
    }
}

/// Runtime versions whose answer does not depend on the inputs.
fn fixed_answer(runtime_version: u32) -> Option<[u64; 2]> {
    match runtime_version % 10 {
        0 => Some([0x3341_181c_03cb_675c, 0x8ed3_83aa_1f4c_d1e8]),
        1 => Some([0x1841_181c_03cb_675c, 0x8ed3_83aa_1f4c_d1e8]),
        _ => None,
    }
}

/// The 16 bytes the check answers, as cudart reads them (two native-endian words).
pub fn answer(record: &Record, devices: &[DeviceIdentity]) -> [u8; 16] {
    if let Some(words) = fixed_answer(record.runtime_version) {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&words[0].to_ne_bytes());
        out[8..].copy_from_slice(&words[1].to_ne_bytes());
        return out;
    }
    let mut mac = <Hmac<Md2> as KeyInit>::new_from_slice(&KEY).expect("HMAC takes any key length");
    mac.update(&record.bytes());
    for d in devices {
        mac.update(&d.bytes());
    }
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(runtime_version: u32) -> Record {
        Record {
            driver_version: 13050,
            runtime_version,
            process: 4242,
            thread: 0x1234_5678,
            cudart_table: 0x7f00_0000_1000,
            integrity_table: 0x7f00_0000_2000,
            check_function: 0x7f00_0000_3000,
            unix_seconds: 1_790_000_000,
        }
    }

    const DEVICE: DeviceIdentity = DeviceIdentity {
        uuid: *b"vgpu-compute-000",
        pci_domain: 0,
        pci_bus: 0,
        pci_device: 0,
    };

    #[test]
    fn layouts_are_what_the_check_hashes() {
        let b = record(13052).bytes();
        assert_eq!(&b[..4], &13050u32.to_ne_bytes());
        assert_eq!(&b[4..8], &13052u32.to_ne_bytes());
        assert_eq!(&b[12..16], &0x1234_5678u32.to_ne_bytes());
        assert_eq!(&b[40..48], &1_790_000_000u64.to_ne_bytes());
        let d = DeviceIdentity {
            pci_bus: 7,
            ..DEVICE
        }
        .bytes();
        assert_eq!(&d[..16], b"vgpu-compute-000");
        assert_eq!(&d[20..24], &7i32.to_ne_bytes());
    }

    #[test]
    fn the_answer_is_hmac_md2_of_record_and_devices() {
        // The same construction spelled out by hand (RFC 2104 with MD2's 16-byte block: the
        // 16-byte key is used as it is), so a change of crate or of the message order shows.
        use md2::Digest;
        let r = record(13052);
        let mut message = r.bytes().to_vec();
        message.extend_from_slice(&DEVICE.bytes());
        let pad = |x: u8| KEY.map(|k| k ^ x);
        let inner = Md2::new()
            .chain_update(pad(0x36))
            .chain_update(&message)
            .finalize();
        let outer = Md2::new()
            .chain_update(pad(0x5c))
            .chain_update(inner)
            .finalize();
        assert_eq!(answer(&r, &[DEVICE]), outer.as_slice());
        // Every input matters.
        let other = Record {
            thread: r.thread + 1,
            ..r
        };
        assert_ne!(answer(&other, &[DEVICE]), answer(&r, &[DEVICE]));
        assert_ne!(answer(&r, &[]), answer(&r, &[DEVICE]));
    }

    #[test]
    fn versions_ending_in_0_or_1_get_fixed_answers() {
        let a = answer(&record(13050), &[DEVICE]);
        assert_eq!(a, answer(&record(12000), &[]));
        assert_eq!(&a[..8], &0x3341_181c_03cb_675cu64.to_ne_bytes());
        let b = answer(&record(12091), &[DEVICE]);
        assert_eq!(&b[..8], &0x1841_181c_03cb_675cu64.to_ne_bytes());
        assert_eq!(&a[8..], &b[8..]);
    }
}
