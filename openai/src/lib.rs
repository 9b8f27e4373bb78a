//! `leanstream-openai`: an OpenAI-compatible local HTTP endpoint for `leanstreamd`
//! (docs/openai.md). Each request opens a daemon session through the `leanstream` client
//! library, streams the generation, and closes the session.
//!
//! - [`cli`]: the command line and the loopback-only rule;
//! - [`listen`]: the listening socket (TCP, Unix mode 0660, systemd socket activation) and each
//!   connection's [`listen::Peer`];
//! - `identity`: which daemon connection serves a peer (the caller's own uid over the socket);
//! - `request` / `response`: OpenAI's request fields and response shapes;
//! - `generate`: one generation's session, from open to close;
//! - `routes`: the HTTP routes; [`server`]: serving and shutdown.

// `leanstream::Error` is large (it keeps zbus's error whole), as in the client library.
#![allow(clippy::result_large_err)]

pub mod cli;
mod error;
mod generate;
mod identity;
pub mod listen;
mod request;
mod response;
mod routes;
pub mod server;

pub use identity::{Identities, MAX_USERS};
