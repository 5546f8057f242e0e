//! How ranks start on each backend (threads, MPI, NCCL, threads sharing a
//! GPU) and how their results become one.

use super::config::{engine_config, model_vars, preemption, validate};
use super::outputs::check_outputs;
use super::rank_model::Model;
use super::train_loop::{train_loop, LoopContext};
use super::{Args, Backend, Precision, Summary, TrainError, TrainingData};
use candle_core::{Device, WithDType};
use std::sync::Arc;
use std::time::Duration;
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::comm::Host;
use zero_core::optim::Float;
use zero_core::{Communicator, Preemption, ThreadGroup};

/// `--timeout-s` as a duration (every backend's collective deadline).
fn timeout(args: &Args) -> Result<Duration, TrainError> {
    Duration::try_from_secs_f64(args.timeout_s).map_err(|e| {
        TrainError::Usage(format!(
            "--timeout-s {} is not a usable duration ({e}); give seconds, e.g. 300",
            args.timeout_s
        ))
    })
}

/// Runs training as the flags say; the backend decides how ranks start.
/// The signals of `--preempt-signals` stop it at a step boundary
/// ([`Outcome::Preempted`](super::Outcome::Preempted)).
pub fn run(args: &Args) -> Result<Summary, TrainError> {
    validate(args)?;
    // Signals are process-wide: one handle, shared by the ranks of this
    // process (a clone each).
    let preemption = preemption(args)?;
    run_with_preemption(args, &|_| preemption.clone())
}

/// [`run`] with the preemption handle each rank polls at its step
/// boundaries given by `preemption(rank)` instead of `--preempt-signals`:
/// a test stops one rank of the thread backend with
/// [`Preemption::requested_at_poll`] (signals reach every thread).
pub fn run_with_preemption(
    args: &Args,
    preemption: &(dyn Fn(usize) -> Preemption + Sync),
) -> Result<Summary, TrainError> {
    validate(args)?;
    let data = Arc::new(TrainingData::from_args(args)?);
    match args.backend {
        Backend::Threads => {
            let world_size = args.world_size as usize;
            let group = ThreadGroup::new(world_size).with_timeout(timeout(args)?);
            let results = group.run(|comm| {
                let preemption = preemption(comm.rank());
                train_rank(args, comm, &data, &preemption)
            });
            collect(results)
        }
        Backend::Mpi => run_mpi(args, &data, preemption),
        Backend::Nccl => run_nccl(args, &data, preemption),
        Backend::CudaThreads => run_cuda_threads(args, &data, preemption),
    }
}

/// How a rank's preemption handle is chosen.
type PreemptionOf<'a> = &'a (dyn Fn(usize) -> Preemption + Sync);

#[cfg(feature = "nccl")]
fn run_nccl(
    args: &Args,
    data: &Arc<TrainingData>,
    preemption: PreemptionOf<'_>,
) -> Result<Summary, TrainError> {
    use zero_nccl::NcclComm;
    let comm = NcclComm::from_env()
        .map_err(zero_core::Error::from)?
        .with_timeout(timeout(args)?);
    let device = Device::new_cuda(comm.context().ordinal())?;
    let preemption = preemption(comm.rank());
    train_gpu_rank(args, comm, device, data, &preemption)
}

/// `--backend cuda-threads`: the ranks as threads sharing GPU 0, each with
/// its own Candle stream.
#[cfg(feature = "nccl")]
fn run_cuda_threads(
    args: &Args,
    data: &Arc<TrainingData>,
    preemption: PreemptionOf<'_>,
) -> Result<Summary, TrainError> {
    use zero_nccl::{CudaThreadGroup, DeviceComm};
    let group = CudaThreadGroup::new(args.world_size as usize).with_timeout(timeout(args)?);
    let results = group.run(|comm| {
        let device = Device::new_cuda_with_stream(comm.context().ordinal());
        let preemption = preemption(comm.rank());
        Ok(device
            .map_err(TrainError::from)
            .and_then(|device| train_gpu_rank(args, comm, device, data, &preemption)))
    })?;
    collect(results)
}

/// One rank's training on a GPU backend, the model on `device`.
#[cfg(feature = "nccl")]
fn train_gpu_rank<C>(
    args: &Args,
    comm: C,
    device: Device,
    data: &TrainingData,
    preemption: &Preemption,
) -> Result<Summary, TrainError>
where
    C: zero_nccl::DeviceComm,
{
    let (rank, world_size) = (comm.rank(), comm.world_size());
    if rank == 0 {
        check_outputs(args)?;
    }
    let map = model_vars(args, data)?;
    let hook = zero_candle::ZeroHook::<C, f32>::new();
    let model = Model::new(args, data, &map, &device, hook.clone())?;
    let mut opt = ZeroOptimizer::<C, f32>::new_sharded(
        &map,
        comm,
        engine_config(args),
        super::optimizers::build(args)?,
        &hook,
    )?;
    let ctx = LoopContext {
        args,
        rank,
        world_size,
        device: &device,
        model: &model,
        preemption,
    };
    train_loop(&ctx, &mut opt)
}

#[cfg(not(feature = "nccl"))]
fn run_nccl(_: &Args, _: &Arc<TrainingData>, _: PreemptionOf<'_>) -> Result<Summary, TrainError> {
    Err(TrainError::Usage(
        "--backend nccl trains on GPUs and needs a build with `--features nccl` on a machine \
         with CUDA; launch one process per GPU with `torchrun`-style variables or `mpirun`"
            .into(),
    ))
}

#[cfg(not(feature = "nccl"))]
fn run_cuda_threads(
    _: &Args,
    _: &Arc<TrainingData>,
    _: PreemptionOf<'_>,
) -> Result<Summary, TrainError> {
    Err(TrainError::Usage(
        "--backend cuda-threads trains on a GPU and needs a build with `--features nccl` on a \
         machine with CUDA"
            .into(),
    ))
}

#[cfg(feature = "mpi")]
fn run_mpi(
    args: &Args,
    data: &Arc<TrainingData>,
    preemption: PreemptionOf<'_>,
) -> Result<Summary, TrainError> {
    use zero_mpi_gloo::MpiComm;
    let timeout = timeout(args)?;
    let comm = MpiComm::init()
        .map_err(zero_core::Error::from)?
        .with_timeout(Some(timeout));
    comm.abort_on_panic();
    // A second handle on the same ranks outlives the optimizer, so a rank
    // that fails can end the whole job (naming itself) instead of leaving
    // its peers waiting in a collective. Split after the deadline is set:
    // the split inherits it.
    let everyone: Vec<usize> = (0..comm.world_size()).collect();
    let keeper = comm
        .split(&everyone)?
        .ok_or_else(|| TrainError::Internal("this rank is missing from its own world".into()))?;
    let preemption = preemption(comm.rank());
    match train_rank(args, comm, data, &preemption) {
        Ok(summary) => {
            // A preempted job ends non-zero on every rank, and mpirun ends
            // the job at the first such exit: rank 0 says where it saved
            // before any rank may leave.
            if let super::Outcome::Preempted { step, checkpoint } = &summary.outcome {
                if summary.rank == 0 {
                    let argv = std::env::args_os();
                    eprintln!(
                        "{}",
                        super::preempted_message(args, *step, checkpoint.as_deref(), argv)
                    );
                }
                keeper.barrier()?;
            }
            Ok(summary)
        }
        Err(e) => keeper.abort(&e.to_string()),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Args, _: &Arc<TrainingData>, _: PreemptionOf<'_>) -> Result<Summary, TrainError> {
    Err(TrainError::Usage(
        "--backend mpi needs a build with `--features mpi` (and Open MPI installed); \
         launch with `mpirun -n N target/release/train --backend mpi ...`"
            .into(),
    ))
}

/// Turns per-rank results into one: rank 0's summary, or the failure that
/// caused the others (a rank's own error beats its peers' reports of it).
fn collect(
    results: Vec<zero_core::Result<Result<Summary, TrainError>>>,
) -> Result<Summary, TrainError> {
    let mut failures = Vec::new();
    let mut summary = None;
    for (rank, result) in results.into_iter().enumerate() {
        match result {
            Ok(Ok(s)) if rank == 0 => summary = Some(s),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => failures.push(TrainError::Rank {
                rank,
                source: Box::new(e),
            }),
            Err(e) => failures.push(TrainError::Rank {
                rank,
                source: Box::new(TrainError::Zero(e)),
            }),
        }
    }
    // Peers of a failed rank report it as a failed peer or a timeout.
    let is_echo = |e: &TrainError| {
        let TrainError::Rank { source, .. } = e else {
            return false;
        };
        let zero = match source.as_ref() {
            TrainError::Zero(z) | TrainError::Adapter(zero_candle::Error::Zero(z)) => z,
            _ => return false,
        };
        matches!(
            zero,
            zero_core::Error::PeerFailed { .. } | zero_core::Error::CollectiveTimeout { .. }
        )
    };
    if let Some(i) = failures.iter().position(|e| !is_echo(e)) {
        return Err(failures.swap_remove(i));
    }
    match (failures.into_iter().next(), summary) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(TrainError::Internal("no rank returned".into())),
    }
}

/// One rank's training loop on a host backend (threads or MPI), polling
/// `preemption` at every step boundary.
pub fn train_rank<C: Communicator<Memory = Host> + 'static>(
    args: &Args,
    comm: C,
    data: &TrainingData,
    preemption: &Preemption,
) -> Result<Summary, TrainError> {
    if comm.rank() == 0 {
        check_outputs(args)?;
    }
    // The engine's element type: f32 (the master weights of a 16-bit
    // model), or the model's own without master weights.
    match (args.precision, args.no_master_weights) {
        (Precision::Bf16, true) => train_rank_as::<C, half::bf16>(args, comm, data, preemption),
        (Precision::F16, true) => train_rank_as::<C, half::f16>(args, comm, data, preemption),
        _ => train_rank_as::<C, f32>(args, comm, data, preemption),
    }
}

/// [`train_rank`] with an engine of element type `T`.
fn train_rank_as<C, T>(
    args: &Args,
    comm: C,
    data: &TrainingData,
    preemption: &Preemption,
) -> Result<Summary, TrainError>
where
    C: Communicator<Memory = Host> + 'static,
    T: Float + WithDType,
{
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let map = model_vars(args, data)?;
    let hook = ZeroHook::<C, T>::new();
    let model = Model::new(args, data, &map, &Device::Cpu, hook.clone())?;
    // At stage 3 each rank builds and initializes (or reads) only its
    // shard of the large parameters.
    let mut opt = ZeroOptimizer::<C, T>::new_sharded(
        &map,
        comm,
        engine_config(args),
        super::optimizers::build(args)?,
        &hook,
    )?;
    let ctx = LoopContext {
        args,
        rank,
        world_size,
        device: &Device::Cpu,
        model: &model,
        preemption,
    };
    train_loop(&ctx, &mut opt)
}
