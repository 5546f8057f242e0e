//! One rank's training loop: resume, micro-steps, metrics, validation,
//! checkpoints, then the saved weights, the sample and the loss plot.

use super::metrics::StepMetrics;
use super::progress::Progress;
use super::rank_model::Model;
use super::rank_optimizer::RankOptimizer;
use super::{Args, HubText, LossHistory, Outcome, Summary, TrainError};
use candle_core::Device;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use zero_candle::models::CausalLm;
use zero_core::checkpoint::StepCheckpoints;
use zero_core::engine::{SaveOptions, SavedCheckpoint};
use zero_core::Preemption;

/// What the loop runs on besides the optimizer.
pub(super) struct LoopContext<'a> {
    pub(super) args: &'a Args,
    pub(super) rank: usize,
    pub(super) world_size: usize,
    pub(super) device: &'a Device,
    pub(super) model: &'a Model<'a>,
    /// Polled at every step boundary (a collective).
    pub(super) preemption: &'a Preemption,
}

pub(super) fn train_loop(
    ctx: &LoopContext<'_>,
    opt: &mut dyn RankOptimizer,
) -> Result<Summary, TrainError> {
    let LoopContext {
        args,
        rank,
        world_size,
        device,
        model,
        preemption,
    } = *ctx;
    // Resuming: weights, optimizer state, step counter, data position and
    // learning rate come from the checkpoint (any world size and stage); a
    // learning-rate schedule then sets the rate of each step from its index.
    let mut first_step = 0;
    // Rows of the dataset (MLP) or sequences (GPT) consumed before this run
    // (counted in rows, so a resume with another world size or batch size
    // continues at the same row; a GPT sequence's text is a function of the
    // seed and its index, so the count is its whole data position).
    let mut rows_consumed = 0;
    if let Some(resume) = &args.resume {
        // The latest complete checkpoint of a --checkpoint-dir, a step
        // directory of one, or a directory holding a manifest.
        let dir = &StepCheckpoints::resolve(resume)?;
        if rank == 0 && !args.quiet && dir != resume {
            eprintln!("resuming from {}", dir.display());
        }
        let manifest = opt.load_checkpoint(dir)?;
        let user = manifest.checkpoint.map(|c| c.user).unwrap_or_default();
        first_step = user["step"].as_u64().ok_or_else(|| TrainError::Data {
            path: dir.clone(),
            detail: "the checkpoint records no trainer step; was it saved by `train`?".into(),
        })?;
        rows_consumed = user["rows_consumed"]
            .as_u64()
            .ok_or_else(|| TrainError::Data {
                path: dir.clone(),
                detail: "the checkpoint records no data position (`rows_consumed`)".into(),
            })?;
        if let Some(lr) = user["lr"].as_f64() {
            opt.set_learning_rate(lr);
        }
        if first_step >= args.steps {
            // A restart loop that runs the same command again after the
            // run completed lands here: a success, with nothing to do.
            if rank == 0 && !args.quiet {
                eprintln!(
                    "{}: the checkpoint is at step {first_step}, at or past --steps {}: nothing \
                     to train (raise --steps to train on)",
                    dir.display(),
                    args.steps
                );
            }
            // A prune killed part-way, after the last save, leaves its
            // hidden directory: this run finishes it.
            if let (Some(dir), Some(keep), 0) = (&args.checkpoint_dir, args.keep_checkpoints, rank)
            {
                StepCheckpoints::new(dir).prune(usize::try_from(keep).unwrap_or(usize::MAX))?;
            }
            save_final_weights(args, opt, model, rank)?;
            return Ok(Summary {
                final_loss: f64::NAN,
                steps: first_step,
                val_loss: None,
                sample: None,
                deferred_steps: 0,
                outcome: Outcome::AlreadyDone {
                    checkpoint_step: first_step,
                },
                rank,
            });
        }
    }
    let mut metrics = match (&args.metrics, rank) {
        (Some(path), 0) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).map_err(|e| TrainError::Data {
                path: path.clone(),
                detail: format!("cannot create metrics file: {e}"),
            })?,
        )),
        _ => None,
    };
    let tokens_per_row = model.tokens_per_row(args);
    let progress = Progress::new(
        rank == 0 && !args.quiet,
        args.steps,
        if tokens_per_row.is_some() {
            "tokens/s"
        } else {
            "samples/s"
        },
    );
    let mut history = LossHistory::default();
    let mut val_loss = None;

    let checkpoints = args.checkpoint_dir.as_deref().map(StepCheckpoints::new);
    let schedule = super::config::lr_schedule(args)?;
    let batch = args.batch_size as usize;
    let accum = args.grad_accum;
    let mut final_loss = f64::NAN;
    for step in first_step..args.steps {
        let started = Instant::now();
        let bytes_before = opt.bytes_sent();
        if let Some(schedule) = &schedule {
            opt.set_learning_rate(schedule.lr_at(step));
        }
        let lr = opt.learning_rate();
        let mut loss_sum = 0.0;
        let mut report = None;
        for micro in 0..accum {
            let micro_steps_done = (step - first_step) * accum + micro;
            let first_row = rows_consumed + micro_steps_done * (world_size * batch) as u64;
            let loss = model.batch_loss(args, first_row, world_size, rank, device)?;
            // The layers hand their gradients to the engine during
            // backward (none stays in Candle's GradStore).
            report = opt.backward_step(&loss)?;
            // Read once the step is queued: on a GPU, reading it first
            // would wait for the forward, the device idle while the host
            // then queues the backward.
            loss_sum += loss.to_scalar::<f32>()? as f64;
        }
        let report = report.ok_or_else(|| {
            TrainError::Internal("the last micro-step did not complete a step".into())
        })?;
        final_loss = opt.mean_over_ranks(loss_sum / accum as f64)?;
        let step_time_s = started.elapsed().as_secs_f64();
        let samples_per_s = (world_size * batch) as f64 * accum as f64 / step_time_s;
        let tokens_per_s = tokens_per_row.map(|t| samples_per_s * t as f64);
        // Validation is timed apart from the step (it is not training).
        let eval_now =
            args.eval_every > 0 && ((step + 1) % args.eval_every == 0 || step + 1 == args.steps);
        let step_val_loss = if eval_now {
            model.validation_loss(args, opt, world_size, rank, device)?
        } else {
            None
        };
        if step_val_loss.is_some() {
            val_loss = step_val_loss;
        }
        if rank == 0 {
            history.train.push((step + 1, final_loss));
            if let Some(v) = step_val_loss {
                history.validation.push((step + 1, v));
            }
        }
        if let Some(out) = metrics.as_mut() {
            let line = StepMetrics {
                step: step + 1,
                loss: final_loss,
                val_loss: step_val_loss,
                lr,
                grad_norm: report.grad_norm,
                step_time_s,
                tokens_per_s,
                bytes_sent: opt.bytes_sent() - bytes_before,
                memory: opt.memory_report(),
                loss_scale: report.loss_scale,
                skipped: report.skipped,
                peak_heap_bytes: crate::heap::peak_bytes(),
                device_peak_bytes: opt.device_peak_bytes(),
                gathers: opt.gather_metrics(),
                offload: opt.offload_metrics(),
            };
            let path = args.metrics.clone().unwrap_or_default();
            serde_json::to_writer(&mut *out, &line)
                .map_err(std::io::Error::from)
                .and_then(|_| out.write_all(b"\n"))
                .map_err(|e| TrainError::Data {
                    path,
                    detail: format!("cannot write metrics: {e}"),
                })?;
        }
        progress.step(
            step + 1,
            final_loss,
            tokens_per_s.unwrap_or(samples_per_s),
            step_val_loss,
        );
        // What a checkpoint of this step records besides the engine's state.
        let user = serde_json::json!({
            "step": step + 1,
            "rows_consumed": rows_consumed
                + (step + 1 - first_step) * accum * (world_size * batch) as u64,
            "lr": opt.learning_rate(),
        });
        let keep = args.keep_checkpoints;
        // The checkpoint of this step, once complete.
        let mut saved = None;
        if let Some(checkpoints) = &checkpoints {
            let due = args.checkpoint_every > 0 && (step + 1) % args.checkpoint_every == 0;
            if due && args.checkpoint_async {
                // The save before it completes first (and is committed).
                let options = SaveOptions {
                    user: user.clone(),
                    ..SaveOptions::default()
                };
                let previous =
                    opt.save_checkpoint_async(&checkpoints.next_dir(step + 1), &options)?;
                commit_saved(opt, checkpoints, previous, rank, keep)?;
            } else if due {
                saved = Some(save_step(
                    opt,
                    checkpoints,
                    step + 1,
                    user.clone(),
                    rank,
                    keep,
                )?);
            } else if args.checkpoint_async {
                // `latest` moves at the first step boundary after every
                // rank has written its files.
                let written = opt.poll_checkpoint()?;
                commit_saved(opt, checkpoints, written, rank, keep)?;
            }
        }
        // Every rank, every step, here: the agreement is a collective, so
        // all stop after the same step even if one alone got the signal.
        // At the last step there is nothing left to stop.
        if opt.should_stop(preemption)? && step + 1 < args.steps {
            let checkpoint = match (&checkpoints, saved) {
                (_, Some(dir)) => Some(dir),
                (Some(checkpoints), None) => {
                    // A background save in flight completes first; when it
                    // is this step's, it is the checkpoint. Otherwise the
                    // preemption's save is a blocking one.
                    let in_flight = opt.wait_checkpoint()?;
                    let waited = commit_saved(opt, checkpoints, in_flight, rank, keep)?;
                    match waited {
                        Some(dir) if dir == checkpoints.next_dir(step + 1) => Some(dir),
                        _ => Some(save_step(opt, checkpoints, step + 1, user, rank, keep)?),
                    }
                }
                (None, None) => None,
            };
            progress.stop();
            flush_metrics(args, metrics.as_mut())?;
            return Ok(Summary {
                final_loss,
                steps: step + 1,
                val_loss,
                sample: None,
                deferred_steps: opt.deferred_steps(),
                outcome: Outcome::Preempted {
                    step: step + 1,
                    checkpoint,
                },
                rank,
            });
        }
    }
    progress.finish(final_loss);
    flush_metrics(args, metrics.as_mut())?;
    if let Some(checkpoints) = &checkpoints {
        let in_flight = opt.wait_checkpoint()?;
        commit_saved(opt, checkpoints, in_flight, rank, args.keep_checkpoints)?;
    }

    // Every rank: saving is a collective (at stage 3 each sharded weight is
    // gathered, written and dropped in turn), and at stage 3 so is every
    // forward (the sample).
    save_final_weights(args, opt, model, rank)?;
    let mut sample = None;
    let sharded = args.stage == 3;
    if rank == 0 || sharded {
        if let (Model::Hub(gpt2, hub), true) = (model, args.sample > 0) {
            let text = hub_sample(args, gpt2, hub, device)?;
            if !args.quiet && rank == 0 {
                println!(
                    "--- sample ({} tokens after {:?}, trained on {}) ---\n{}{text}\n---",
                    args.sample, args.prompt, hub.text.source, args.prompt
                );
            }
            sample = (rank == 0).then(|| text.into_bytes());
        }
        if let (Model::Gpt(gpt, text), true) = (model, args.sample > 0) {
            let bytes = gpt.generate(
                args.prompt.as_bytes(),
                args.sample as usize,
                args.temperature,
                args.seed,
                device,
            )?;
            if !args.quiet && rank == 0 {
                println!(
                    "--- sample ({} bytes after {:?}, trained on {}) ---\n{}{}\n---",
                    bytes.len(),
                    args.prompt,
                    text.source,
                    args.prompt,
                    String::from_utf8_lossy(&bytes)
                );
            }
            sample = (rank == 0).then_some(bytes);
        }
    }
    if rank == 0 {
        if let Some(path) = &args.plot {
            let title = match model {
                Model::Gpt(gpt, _) => {
                    let c = gpt.config();
                    format!(
                        "GPT (layers {}, d_model {}, context {}), world size {world_size}, stage {}",
                        c.layers, c.d_model, c.context, args.stage
                    )
                }
                Model::Hub(_, hub) => format!(
                    "{}, world size {world_size}, stage {}",
                    hub.hub.dir().display(),
                    args.stage
                ),
                Model::Mlp(..) => format!("MLP, world size {world_size}, stage {}", args.stage),
            };
            history.plot(path, &title)?;
            if !args.quiet {
                eprintln!("loss plot written to {}", path.display());
            }
        }
    }
    Ok(Summary {
        final_loss,
        steps: args.steps,
        val_loss,
        sample,
        deferred_steps: opt.deferred_steps(),
        outcome: Outcome::Finished,
        rank,
    })
}

/// Saves the checkpoint of `step` into its step directory (a collective),
/// then, on rank 0, points `latest` at it and removes what
/// `--keep-checkpoints` does not keep. Returns the step directory.
fn save_step(
    opt: &mut dyn RankOptimizer,
    checkpoints: &StepCheckpoints,
    step: u64,
    user: serde_json::Value,
    rank: usize,
    keep: Option<u64>,
) -> Result<PathBuf, TrainError> {
    let dir = checkpoints.next_dir(step);
    let options = SaveOptions {
        user,
        ..SaveOptions::default()
    };
    opt.save_checkpoint(&dir, &options)?;
    // The save returns on every rank once the manifest is in place.
    commit_step(opt, checkpoints, &dir, rank, keep)
}

/// Commits a background save that completed (`None`: none did): see
/// [`commit_step`]. Returns its step directory.
fn commit_saved(
    opt: &mut dyn RankOptimizer,
    checkpoints: &StepCheckpoints,
    saved: Option<SavedCheckpoint>,
    rank: usize,
    keep: Option<u64>,
) -> Result<Option<PathBuf>, TrainError> {
    match saved {
        Some(saved) => commit_step(opt, checkpoints, &saved.dir, rank, keep).map(Some),
        None => Ok(None),
    }
}

/// Once the checkpoint in the step directory `dir` is complete on every
/// rank: on rank 0, points `latest` at it and removes what
/// `--keep-checkpoints` does not keep; every rank learns how that went (a
/// collective). Returns the step directory.
fn commit_step(
    opt: &mut dyn RankOptimizer,
    checkpoints: &StepCheckpoints,
    dir: &Path,
    rank: usize,
    keep: Option<u64>,
) -> Result<PathBuf, TrainError> {
    let dir = dir.to_path_buf();
    let committed = if rank == 0 {
        checkpoints.commit_dir(&dir).and_then(|_| match keep {
            Some(keep) => checkpoints
                .prune(usize::try_from(keep).unwrap_or(usize::MAX))
                .map(drop),
            None => Ok(()),
        })
    } else {
        Ok(())
    };
    // Every rank waits for rank 0's commit and learns how it went: a rank
    // that went on to exit (a preemption) could have its launcher end the
    // job, rank 0 with it, before `latest` is written.
    let failed = opt.mean_over_ranks(if committed.is_ok() { 0.0 } else { 1.0 })? > 0.0;
    committed?;
    if failed {
        return Err(TrainError::Data {
            path: dir,
            detail: "rank 0 could not point `latest` at this checkpoint; see its error".into(),
        });
    }
    Ok(dir)
}

/// Flushes the `--metrics` file, if any.
fn flush_metrics(
    args: &Args,
    metrics: Option<&mut std::io::BufWriter<std::fs::File>>,
) -> Result<(), TrainError> {
    let Some(out) = metrics else {
        return Ok(());
    };
    out.flush().map_err(|e| TrainError::Data {
        path: args.metrics.clone().unwrap_or_default(),
        detail: format!("cannot write metrics: {e}"),
    })
}

/// `--sample` tokens of the hub model after `--prompt`, decoded by its
/// tokenizer (an empty prompt starts after the end-of-text token).
fn hub_sample(
    args: &Args,
    model: &CausalLm,
    hub: &HubText,
    device: &Device,
) -> Result<String, TrainError> {
    let mut prompt = hub.tokenizer.encode(&args.prompt)?;
    if prompt.is_empty() {
        prompt.extend(hub.tokenizer.end_of_text());
    }
    if prompt.is_empty() {
        return Err(TrainError::Usage(
            "--prompt is empty and the tokenizer has no end-of-text token to start from; give \
             a --prompt"
                .into(),
        ));
    }
    let ids = super::sample::continue_ids(
        &prompt,
        args.sample as usize,
        args.context as usize,
        args.temperature,
        args.seed,
        device,
        |ids| model.forward(ids)?.squeeze(0),
    )?;
    hub.tokenizer.decode(&ids)
}

/// `--save` and `--save-hf`: the model's weights at the end (a collective:
/// at stage 3 each sharded weight is gathered, written and dropped in
/// turn).
fn save_final_weights(
    args: &Args,
    opt: &mut dyn RankOptimizer,
    model: &Model<'_>,
    rank: usize,
) -> Result<(), TrainError> {
    if let Some(path) = &args.save {
        opt.save_weights(path)?;
    }
    if let (Some(out), Model::Hub(_, hub)) = (&args.save_hf, model) {
        opt.save_hub(out, &hub.hub, &hub.config.hub_layout())?;
        if !args.quiet && rank == 0 {
            eprintln!("fine-tuned model written to {}", out.display());
        }
    }
    Ok(())
}
