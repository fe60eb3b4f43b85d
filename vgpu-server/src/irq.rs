//! Interrupt delivery: the eventfds QEMU hands over with SET_IRQS.
//!
//! MSI-X: one eventfd per vector (QEMU emulates the table; a vector without an fd is disabled).
//! INTx: a trigger eventfd with VFIO's automask semantics (the line is masked when it fires and
//! unmasked by an UNMASK action, or by the KVM resample eventfd when the guest EOIs), so a
//! level-triggered ISR bit that is still pending fires again after the unmask.

use std::fs::File;
use std::io::Write;

use log::{debug, warn};

use crate::fds;
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_TYPE_MASK,
    VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
    VFIO_IRQ_SET_DATA_TYPE_MASK, VFIO_PCI_ERR_IRQ_INDEX, VFIO_PCI_INTX_IRQ_INDEX,
    VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_REQ_IRQ_INDEX,
};

/// Errors of SET_IRQS; each is answered to QEMU with an error reply.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IrqError {
    /// An index the device does not have.
    #[error("no interrupt index {0}")]
    UnknownIndex(u32),
    /// start + count beyond the index's vectors.
    #[error("interrupt index {index}: vectors {start}+{count} out of range ({max})")]
    OutOfRange {
        /// Interrupt index.
        index: u32,
        /// First vector.
        start: u32,
        /// Number of vectors.
        count: u32,
        /// Vectors of the index.
        max: u32,
    },
    /// The number of fds does not match count.
    #[error("interrupt index {index}: {fds} fds for {count} vectors")]
    FdCount {
        /// Interrupt index.
        index: u32,
        /// Vectors named.
        count: u32,
        /// Fds received.
        fds: usize,
    },
    /// A descriptor handed over as an interrupt eventfd is something else (a pipe or socket
    /// could block the device's write), or could not be made non-blocking.
    #[error("interrupt index {index}: descriptor {position} is not a usable eventfd")]
    NotEventfd {
        /// Interrupt index.
        index: u32,
        /// Its position among the message's descriptors.
        position: usize,
    },
    /// A data/action combination this device does not implement.
    #[error("interrupt index {index}: unsupported SET_IRQS flags {flags:#x}")]
    Unsupported {
        /// Interrupt index.
        index: u32,
        /// The flags.
        flags: u32,
    },
}

/// What the caller must do after SET_IRQS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IrqChange {
    /// Nothing else.
    None,
    /// INTx was unmasked: re-assert it if the ISR is still pending.
    IntxUnmasked,
    /// The INTx resample eventfd changed: the worker must watch the new one.
    ResampleChanged,
}

/// The interrupt eventfds of one connection.
#[derive(Debug)]
pub struct Interrupts {
    msix: Vec<Option<File>>,
    intx: Option<File>,
    intx_resample: Option<File>,
    intx_masked: bool,
}

impl Interrupts {
    /// No eventfds yet; `msix_vectors` is the size of the MSI-X table.
    pub fn new(msix_vectors: u16) -> Self {
        Interrupts {
            msix: (0..msix_vectors).map(|_| None).collect(),
            intx: None,
            intx_resample: None,
            intx_masked: false,
        }
    }

    /// Whether the guest uses MSI-X (QEMU passes vector fds once the guest enables it).
    pub fn msix_enabled(&self) -> bool {
        self.msix.iter().any(Option::is_some)
    }

    /// A duplicate of the INTx resample eventfd, for the worker's poll set.
    pub fn resample_fd(&self) -> Option<File> {
        self.intx_resample.as_ref().and_then(|f| f.try_clone().ok())
    }

    /// Handles SET_IRQS after the crate checked the index against the device's IRQ list.
    pub fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> Result<IrqChange, IrqError> {
        let data = flags & VFIO_IRQ_SET_DATA_TYPE_MASK;
        let action = flags & VFIO_IRQ_SET_ACTION_TYPE_MASK;
        let unsupported = || IrqError::Unsupported { index, flags };
        let max = match index {
            VFIO_PCI_INTX_IRQ_INDEX => 1,
            VFIO_PCI_MSIX_IRQ_INDEX => self.msix.len() as u32,
            VFIO_PCI_MSI_IRQ_INDEX | VFIO_PCI_ERR_IRQ_INDEX | VFIO_PCI_REQ_IRQ_INDEX => 0,
            _ => return Err(IrqError::UnknownIndex(index)),
        };
        let end = start.checked_add(count).filter(|&e| e <= max);
        // count 0 with DATA_NONE and TRIGGER means "disable all" and is valid on any index.
        let disable_all =
            count == 0 && data == VFIO_IRQ_SET_DATA_NONE && action == VFIO_IRQ_SET_ACTION_TRIGGER;
        if end.is_none() && !disable_all {
            return Err(IrqError::OutOfRange {
                index,
                start,
                count,
                max,
            });
        }
        if data == VFIO_IRQ_SET_DATA_EVENTFD && !fds.is_empty() && fds.len() != count as usize {
            return Err(IrqError::FdCount {
                index,
                count,
                fds: fds.len(),
            });
        }
        if data != VFIO_IRQ_SET_DATA_EVENTFD && !fds.is_empty() {
            return Err(IrqError::FdCount {
                index,
                count,
                fds: fds.len(),
            });
        }
        // Only eventfds, and never a blocking one: the device signals under its lock.
        for (position, fd) in fds.iter().enumerate() {
            if !fds::is_eventfd(fd) || fds::set_nonblocking(fd).is_err() {
                return Err(IrqError::NotEventfd { index, position });
            }
        }
        match (index, action, data) {
            (_, VFIO_IRQ_SET_ACTION_TRIGGER, _) if disable_all => {
                debug!("interrupt index {index}: all vectors disabled");
                match index {
                    VFIO_PCI_INTX_IRQ_INDEX => {
                        self.intx = None;
                        self.intx_masked = false;
                    }
                    VFIO_PCI_MSIX_IRQ_INDEX => self.msix.iter_mut().for_each(|v| *v = None),
                    _ => {}
                }
                Ok(IrqChange::None)
            }
            (VFIO_PCI_MSIX_IRQ_INDEX, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD) => {
                let range = start as usize..(start + count) as usize;
                if fds.is_empty() {
                    // A run of vectors without fds: QEMU disables them.
                    self.msix[range].iter_mut().for_each(|v| *v = None);
                } else {
                    for (slot, fd) in self.msix[range].iter_mut().zip(fds) {
                        *slot = Some(fd);
                    }
                }
                debug!(
                    "MSI-X vectors {start}+{count} set ({} with fds)",
                    self.msix.iter().flatten().count()
                );
                Ok(IrqChange::None)
            }
            (VFIO_PCI_INTX_IRQ_INDEX, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD) => {
                self.intx = fds.into_iter().next();
                self.intx_masked = false;
                debug!(
                    "INTx trigger eventfd {}",
                    if self.intx.is_some() {
                        "set"
                    } else {
                        "cleared"
                    }
                );
                Ok(IrqChange::None)
            }
            (VFIO_PCI_INTX_IRQ_INDEX, VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_DATA_NONE) => {
                self.intx_masked = true;
                Ok(IrqChange::None)
            }
            (VFIO_PCI_INTX_IRQ_INDEX, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_NONE) => {
                self.intx_masked = false;
                Ok(IrqChange::IntxUnmasked)
            }
            (VFIO_PCI_INTX_IRQ_INDEX, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD) => {
                self.intx_resample = fds.into_iter().next();
                debug!(
                    "INTx resample eventfd {}",
                    if self.intx_resample.is_some() {
                        "set"
                    } else {
                        "cleared"
                    }
                );
                Ok(IrqChange::ResampleChanged)
            }
            _ => Err(unsupported()),
        }
    }

    /// Signals MSI-X `vector`; false if it has no eventfd or the write failed.
    pub fn trigger_msix(&self, vector: u16) -> bool {
        match self.msix.get(usize::from(vector)).and_then(Option::as_ref) {
            Some(fd) => signal(fd),
            None => false,
        }
    }

    /// Asserts INTx unless it is masked; firing masks it until the next unmask.
    pub fn trigger_intx(&mut self) -> bool {
        if self.intx_masked {
            return false;
        }
        match &self.intx {
            Some(fd) if signal(fd) => {
                self.intx_masked = true;
                true
            }
            _ => false,
        }
    }

    /// Unmasks INTx (the guest's EOI, seen through the resample eventfd).
    pub fn unmask_intx(&mut self) {
        self.intx_masked = false;
    }
}

/// Adds one to an interrupt eventfd. A full counter (EAGAIN: the fd is non-blocking) already
/// reads as pending, so it counts as signalled.
fn signal(mut fd: &File) -> bool {
    match fd.write_all(&1u64.to_ne_bytes()) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => true,
        Err(e) => {
            warn!("interrupt eventfd write failed: {e}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    const TRIGGER_FD: u32 = VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD;

    /// An eventfd for the device and a second handle on it to read what the device signalled.
    fn efd() -> (File, File) {
        let e =
            File::from(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap());
        let observer = e.try_clone().unwrap();
        (e, observer)
    }

    /// The eventfd's counter (0 when nothing was signalled); reading resets it.
    fn count(mut rx: &File) -> usize {
        let mut b = [0u8; 8];
        match rx.read(&mut b) {
            Ok(8) => u64::from_ne_bytes(b) as usize,
            _ => 0,
        }
    }

    #[test]
    fn msix_vectors_fire_their_own_eventfd() {
        let mut irqs = Interrupts::new(3);
        let (a, a_obs) = efd();
        let (b, b_obs) = efd();
        irqs.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, TRIGGER_FD, 1, 2, vec![a, b])
            .unwrap();
        assert!(irqs.msix_enabled());
        assert!(!irqs.trigger_msix(0));
        assert!(irqs.trigger_msix(2));
        assert_eq!((count(&a_obs), count(&b_obs)), (0, 1));
        // A run without fds disables those vectors.
        irqs.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, TRIGGER_FD, 2, 1, vec![])
            .unwrap();
        assert!(!irqs.trigger_msix(2));
        irqs.set_irqs(
            VFIO_PCI_MSIX_IRQ_INDEX,
            VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_NONE,
            0,
            0,
            vec![],
        )
        .unwrap();
        assert!(!irqs.msix_enabled());
    }

    #[test]
    fn intx_automasks_until_unmask() {
        let mut irqs = Interrupts::new(3);
        let (t, obs) = efd();
        irqs.set_irqs(VFIO_PCI_INTX_IRQ_INDEX, TRIGGER_FD, 0, 1, vec![t])
            .unwrap();
        assert!(irqs.trigger_intx());
        assert!(!irqs.trigger_intx(), "masked after firing");
        let unmask = VFIO_IRQ_SET_ACTION_UNMASK | VFIO_IRQ_SET_DATA_NONE;
        assert_eq!(
            irqs.set_irqs(VFIO_PCI_INTX_IRQ_INDEX, unmask, 0, 1, vec![]),
            Ok(IrqChange::IntxUnmasked)
        );
        assert!(irqs.trigger_intx());
        assert_eq!(count(&obs), 2);
        let (r, _) = efd();
        let resample = VFIO_IRQ_SET_ACTION_UNMASK | VFIO_IRQ_SET_DATA_EVENTFD;
        assert_eq!(
            irqs.set_irqs(VFIO_PCI_INTX_IRQ_INDEX, resample, 0, 1, vec![r]),
            Ok(IrqChange::ResampleChanged)
        );
        assert!(irqs.resample_fd().is_some());
    }

    #[test]
    fn malformed_requests_are_refused() {
        let mut irqs = Interrupts::new(3);
        assert!(matches!(
            irqs.set_irqs(
                VFIO_PCI_MSIX_IRQ_INDEX,
                TRIGGER_FD,
                2,
                2,
                vec![efd().0, efd().0]
            ),
            Err(IrqError::OutOfRange { .. })
        ));
        assert!(matches!(
            irqs.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, TRIGGER_FD, u32::MAX, 2, vec![]),
            Err(IrqError::OutOfRange { .. })
        ));
        assert!(matches!(
            irqs.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, TRIGGER_FD, 0, 3, vec![efd().0]),
            Err(IrqError::FdCount { .. })
        ));
        assert_eq!(
            irqs.set_irqs(9, TRIGGER_FD, 0, 1, vec![]),
            Err(IrqError::UnknownIndex(9))
        );
        assert!(matches!(
            irqs.set_irqs(
                VFIO_PCI_MSIX_IRQ_INDEX,
                VFIO_IRQ_SET_ACTION_MASK | VFIO_IRQ_SET_DATA_NONE,
                0,
                1,
                vec![]
            ),
            Err(IrqError::Unsupported { .. })
        ));
    }

    #[test]
    fn only_eventfds_are_accepted() {
        let mut irqs = Interrupts::new(3);
        let (sock, _peer) = UnixStream::pair().unwrap();
        let (pipe, _w) = std::io::pipe().unwrap();
        for fd in [
            File::from(std::os::fd::OwnedFd::from(sock)),
            File::from(std::os::fd::OwnedFd::from(pipe)),
        ] {
            assert_eq!(
                irqs.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, TRIGGER_FD, 0, 2, vec![efd().0, fd]),
                Err(IrqError::NotEventfd {
                    index: VFIO_PCI_MSIX_IRQ_INDEX,
                    position: 1
                })
            );
            // Nothing of a refused request is kept.
            assert!(!irqs.msix_enabled());
        }
    }

    #[test]
    fn a_full_eventfd_never_blocks_the_signal() {
        let mut irqs = Interrupts::new(1);
        let (e, obs) = efd();
        irqs.set_irqs(VFIO_PCI_MSIX_IRQ_INDEX, TRIGGER_FD, 0, 1, vec![e])
            .unwrap();
        // QEMU (or whoever holds the other end) filled the counter and stopped reading.
        (&obs).write_all(&(u64::MAX - 1).to_ne_bytes()).unwrap();
        assert!(irqs.trigger_msix(0), "a full counter is already pending");
        assert_eq!(count(&obs), (u64::MAX - 1) as usize);
    }
}
