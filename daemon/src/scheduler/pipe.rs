//! The write end of a token stream: non-blocking, written as far as the reader takes it.

use std::io::{ErrorKind, PipeWriter, Write};

use leanstream::contract::LeanStreamError;

/// Puts the pipe's write end in non-blocking mode.
pub fn set_nonblocking(out: &PipeWriter) -> Result<(), LeanStreamError> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    let flags = fcntl(out, FcntlArg::F_GETFL)
        .map_err(|e| LeanStreamError::Internal(format!("pipe flags: {e}")))?;
    fcntl(
        out,
        FcntlArg::F_SETFL(OFlag::from_bits_retain(flags) | OFlag::O_NONBLOCK),
    )
    .map(drop)
    .map_err(|e| LeanStreamError::Internal(format!("pipe flags: {e}")))
}

/// Writes what the pipe takes of `pending` and drops it from there. `Ok(true)`: bytes are left
/// (the pipe is full); `Err`: the reader is gone.
pub fn flush(out: &mut PipeWriter, pending: &mut Vec<u8>) -> std::io::Result<bool> {
    while !pending.is_empty() {
        match out.write(pending) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                pending.drain(..n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(true),
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}
