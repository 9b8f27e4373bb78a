//! Host memory registered with the driver, and the driver's results as errors.
//!
//! `cust` has safe device buffers but no wrapper for registering existing host memory, so
//! [`HostRegistration`] calls `cuMemHostRegister` through `cust::sys`. Registered memory is
//! page-locked and mapped into the GPU's address space: on Jetson (one memory) kernels read it
//! in place; on a discrete GPU it is the source of asynchronous copies into device memory.

use std::ffi::c_void;

use cust::memory::DevicePointer;
use cust::prelude::*;
use cust::sys::{self, CUresult, cudaError_enum};

use crate::{Error, Result};

/// Checks the result of a raw driver call.
pub fn check(r: CUresult, what: &str) -> Result<()> {
    if r == cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("{what}: {r:?}")))
    }
}

/// Queues a copy of `bytes` host bytes into device memory at `dst` on `stream`.
///
/// # Safety
/// `src` must stay valid and unchanged, and `dst` must hold `bytes` bytes, until the stream has
/// run the copy. For the copy to be asynchronous `src` must be registered or page-locked.
pub unsafe fn copy_to_device_async(
    dst: DevicePointer<u8>,
    src: *const u8,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let r = unsafe {
        sys::cuMemcpyHtoDAsync_v2(dst.as_raw(), src.cast::<c_void>(), bytes, stream.as_inner())
    };
    check(r, "queueing a host-to-device copy")
}

/// A host memory range registered with the driver (page-locked, mapped for the device) for as
/// long as this value lives.
#[derive(Debug)]
pub struct HostRegistration {
    host: *mut u8,
    len: usize,
    device: DevicePointer<u8>,
}

// SAFETY: the registration is process-wide (PORTABLE) and the struct only hands out addresses;
// whoever owns the registered memory keeps its own aliasing rules.
unsafe impl Send for HostRegistration {}
// SAFETY: as above: shared, it hands out addresses only.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers `len` bytes at `host`.
    ///
    /// # Safety
    /// The range must be one allocation that outlives this value and is not freed or
    /// re-registered meanwhile. Page alignment is not required by the driver, but the neuron
    /// cache's arena is 4 KiB-aligned so whole pages are locked.
    pub unsafe fn new(host: *mut u8, len: usize) -> Result<HostRegistration> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller's contract.
        let r = unsafe { sys::cuMemHostRegister_v2(host.cast::<c_void>(), len, flags) };
        check(
            r,
            "registering host memory with CUDA (cuMemHostRegister; is LimitMEMLOCK high enough?)",
        )?;
        let mut device = 0;
        // SAFETY: `host` was registered with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) };
        if let Err(e) = check(r, "mapping registered host memory") {
            // SAFETY: registered above and not yet handed out.
            unsafe { sys::cuMemHostUnregister(host.cast()) };
            return Err(e);
        }
        Ok(HostRegistration {
            host,
            len,
            device: DevicePointer::from_raw(device),
        })
    }

    /// The device address of the host byte at `host`, which must lie inside the range.
    pub fn device_ptr(&self, host: *const u8) -> Option<DevicePointer<u8>> {
        let off = (host as usize).checked_sub(self.host as usize)?;
        (off < self.len).then(|| self.device.wrapping_add(off))
    }

    /// The first registered host byte.
    pub fn host_start(&self) -> *const u8 {
        self.host
    }

    /// Bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is registered (a zero-length range).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, unregistered once here.
        let r = unsafe { sys::cuMemHostUnregister(self.host.cast()) };
        if r != cudaError_enum::CUDA_SUCCESS {
            tracing::warn!("unregistering host memory from CUDA: {r:?}");
        }
    }
}
