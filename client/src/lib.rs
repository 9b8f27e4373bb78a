//! LeanStream client library: the D-Bus contract of `leanstreamd` ([`contract`]) and a client
//! over it, for apps to link without the engine (`default-features = false`).
//!
//! ```no_run
//! # async fn demo() -> leanstream::Result<()> {
//! use leanstream::{Bus, Client, contract::GenerateParams};
//! let client = Client::connect(&Bus::System).await?;
//! let session = client.open_session("smollm2", 0).await?;
//! let stream = session.generate("The robot", &GenerateParams::default()).await?;
//! let generation = stream.finish_with(|text| print!("{text}")).await?;
//! println!("\n{} tokens", generation.ids.len());
//! session.close().await?;
//! # Ok(()) }
//! ```
//!
//! Apps without an async runtime use [`blocking::Client`].

// `Error` carries `zbus::Error` (as zbus's own results do) so that nothing about a failure is
// lost; it is large, but errors are the cold path and every call is a D-Bus round trip anyway.
#![allow(clippy::result_large_err)]

pub mod blocking;
mod bus;
mod client;
pub mod contract;
mod error;
mod options;
mod stream;

pub use bus::Bus;
pub use client::{Client, SessionHandle};
pub use error::{Error, Result, daemon_message};
pub use options::OPTION_KEYS;
pub use stream::{Generation, TokenStream};
