//! The engine's methods, one concern per file, each an `impl Engine` block. The
//! types they work with are the engine's other modules, which know nothing of
//! `Engine`: this folder imports them, and nothing imports this folder.

mod backward;
mod checkpoint;
mod deferred;
mod precision;
mod sharding;
mod stage3;
mod start;
mod step;
mod update;
