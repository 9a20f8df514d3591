//! Owns the runtime's view of the ranks' exchange, which lives in crates/exchange (shared with
//! `import oomguard`): its items, and its error as the runtime's `Error::Dist`.
//! Keeps: one implementation of the channel and its header checks for both fronts.
pub use oomguard_exchange::{
    busiest_neighbours, children, local_ip_towards, parent, Channel, Exchange, ExchangeError, MemoryStore, Reduce,
    Topic, MESSAGE_BYTES, PAYLOAD,
};

impl From<ExchangeError> for crate::error::Error {
    fn from(e: ExchangeError) -> Self {
        crate::error::Error::Dist(e.0)
    }
}
