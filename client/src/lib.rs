//! LeanStream client library (D-Bus contract, built in the daemon issue) and CLI helpers.
