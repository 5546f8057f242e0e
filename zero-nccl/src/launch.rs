//! Where this process sits in the job: rank, world size and GPU, read from
//! the launcher's environment (mpirun or torchrun-style variables).

use crate::{Error, Result};

/// The default `MASTER_ADDR`.
pub const DEFAULT_MASTER_ADDR: &str = "localhost";
/// The default `MASTER_PORT`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher set the environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// A PMI launcher: MPICH/Hydra, Intel MPI, Slurm's `srun --mpi=pmi2` (`PMI_RANK`, `PMI_SIZE`).
    Pmi,
    /// torchrun-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`).
    Torchrun,
}

/// The rank layout and rendezvous address of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Who set the variables.
    pub launcher: Launcher,
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of processes.
    pub world_size: usize,
    /// The rank within this node, which picks the GPU; `None` when the
    /// launcher does not say (the GPU is then `rank % device_count`).
    pub local_rank: Option<usize>,
    /// Host of rank 0's rendezvous server (`MASTER_ADDR`, default `localhost`).
    pub master_addr: String,
    /// Port of rank 0's rendezvous server (`MASTER_PORT`, default 29500).
    pub master_port: u16,
    /// The per-job secret the rendezvous authenticates the ranks with:
    /// `ZERO_RENDEZVOUS_TOKEN` when set, else under Open MPI's `mpirun` the
    /// random key it exports to the job's processes
    /// (`OMPI_MCA_orte_precondition_transports`). `None`: a job of more
    /// than one rank must export `ZERO_RENDEZVOUS_TOKEN` to every rank.
    pub token: Option<String>,
}

impl LaunchEnv {
    /// Reads the process environment; see [`LaunchEnv::from_vars`].
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the layout through `var`, in this order of precedence: Open MPI
    /// (`OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`), PMI (`PMI_RANK`,
    /// `PMI_SIZE`, `MPI_LOCALRANKID`), then torchrun (`RANK`, `WORLD_SIZE`,
    /// `LOCAL_RANK`). `MASTER_ADDR`, `MASTER_PORT` and the token
    /// ([`LaunchEnv::token`]) apply to all three.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let (launcher, rank, size, local) = if var("OMPI_COMM_WORLD_RANK").is_some() {
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                &["OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"][..],
            )
        } else if var("PMI_RANK").is_some() {
            (
                Launcher::Pmi,
                "PMI_RANK",
                "PMI_SIZE",
                &[
                    "MPI_LOCALRANKID",
                    "PMI_LOCAL_RANK",
                    "SLURM_LOCALID",
                    "LOCAL_RANK",
                ][..],
            )
        } else if var("RANK").is_some() {
            (
                Launcher::Torchrun,
                "RANK",
                "WORLD_SIZE",
                &["LOCAL_RANK"][..],
            )
        } else {
            return Err(Error::NoLaunchEnv);
        };
        let rank = parse_usize(&var, rank)?.ok_or(Error::NoLaunchEnv)?;
        let world_size = parse_usize(&var, size)?.ok_or_else(|| Error::Env {
            var: size,
            value: String::new(),
            detail: format!("{size} must be set alongside the rank"),
        })?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::Env {
                var: size,
                value: world_size.to_string(),
                detail: format!("the rank {rank} must be below the world size {world_size}"),
            });
        }
        let mut local_rank = None;
        for name in local {
            if let Some(v) = parse_usize(&var, name)? {
                local_rank = Some(v);
                break;
            }
        }
        let master_addr = var("MASTER_ADDR")
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string());
        let master_port = match var("MASTER_PORT") {
            None => DEFAULT_MASTER_PORT,
            Some(v) => v.trim().parse::<u16>().map_err(|e| Error::Env {
                var: "MASTER_PORT",
                value: v.clone(),
                detail: format!("not a TCP port: {e}"),
            })?,
        };
        let token = [
            "ZERO_RENDEZVOUS_TOKEN",
            "OMPI_MCA_orte_precondition_transports",
        ]
        .into_iter()
        .find_map(|name| var(name).filter(|v| !v.trim().is_empty()));
        Ok(Self {
            launcher,
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            token,
        })
    }
}

/// Parses `name` as a non-negative integer; `Ok(None)` when unset.
fn parse_usize(var: &impl Fn(&str) -> Option<String>, name: &'static str) -> Result<Option<usize>> {
    match var(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|e| Error::Env {
            var: name,
            value: v.clone(),
            detail: format!("expected a non-negative integer: {e}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn torchrun_style() {
        let e = LaunchEnv::from_vars(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(e.launcher, Launcher::Torchrun);
        assert_eq!((e.rank, e.world_size, e.local_rank), (3, 4, Some(1)));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("node0", 1234));
    }

    #[test]
    fn open_mpi_wins_and_defaults_apply() {
        let e = LaunchEnv::from_vars(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("RANK", "0"),
        ]))
        .unwrap();
        assert_eq!(e.launcher, Launcher::OpenMpi);
        assert_eq!((e.rank, e.world_size, e.local_rank), (1, 2, Some(1)));
        assert_eq!(e.master_addr, DEFAULT_MASTER_ADDR);
        assert_eq!(e.master_port, DEFAULT_MASTER_PORT);
    }

    #[test]
    fn pmi_without_local_rank() {
        let e = LaunchEnv::from_vars(env(&[("PMI_RANK", "0"), ("PMI_SIZE", "3")])).unwrap();
        assert_eq!(e.launcher, Launcher::Pmi);
        assert_eq!(e.local_rank, None);
    }

    #[test]
    fn errors_are_clear() {
        assert!(matches!(
            LaunchEnv::from_vars(env(&[])),
            Err(Error::NoLaunchEnv)
        ));
        let err = LaunchEnv::from_vars(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("RANK"), "{err}");
        let err = LaunchEnv::from_vars(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("below the world size"), "{err}");
        let err = LaunchEnv::from_vars(env(&[("RANK", "0")])).unwrap_err();
        assert!(err.to_string().contains("WORLD_SIZE"), "{err}");
        let err = LaunchEnv::from_vars(env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_PORT", "99999"),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
    }

    #[test]
    fn the_token_is_the_users_then_open_mpis_job_key() {
        let base = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let key = ("OMPI_MCA_orte_precondition_transports", "978608a5-a5308de3");
        let e = LaunchEnv::from_vars(env(&[base[0], base[1], key])).unwrap();
        assert_eq!(e.token.as_deref(), Some("978608a5-a5308de3"));
        let mine = ("ZERO_RENDEZVOUS_TOKEN", "mine");
        let e = LaunchEnv::from_vars(env(&[base[0], base[1], key, mine])).unwrap();
        assert_eq!(e.token.as_deref(), Some("mine"));
        let e = LaunchEnv::from_vars(env(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
        assert_eq!(e.token, None, "torchrun exports no secret");
    }
}
