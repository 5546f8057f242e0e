//! Loss curves as PNG files (`train --plot`, the `plot` binary), drawn by
//! plotters with an embedded font, so no system font is needed.

use crate::trainer::TrainError;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::Path;
use std::sync::Once;

/// The losses of a run: `(step, loss)` pairs, in step order.
#[derive(Clone, Debug, Default)]
pub struct LossHistory {
    /// Training loss (mean over the global batch) per step.
    pub train: Vec<(u64, f64)>,
    /// Validation loss at the steps where it was measured.
    pub validation: Vec<(u64, f64)>,
}

impl LossHistory {
    /// Reads the `step`, `loss` and `val_loss` fields of a `--metrics`
    /// file; lines without a loss are skipped.
    pub fn from_metrics(path: &Path) -> Result<Self, TrainError> {
        let bad = |detail: String| TrainError::Data {
            path: path.to_path_buf(),
            detail,
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| bad(format!("cannot read the metrics file: {e}")))?;
        let mut history = Self::default();
        for (number, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                bad(format!(
                    "line {} is not JSON ({e}); is this a `train --metrics` file?",
                    number + 1
                ))
            })?;
            let Some(step) = value["step"].as_u64() else {
                continue;
            };
            if let Some(loss) = value["loss"].as_f64() {
                history.train.push((step, loss));
            }
            if let Some(loss) = value["val_loss"].as_f64() {
                history.validation.push((step, loss));
            }
        }
        if history.train.is_empty() {
            return Err(bad(
                "holds no line with `step` and `loss`; is this a `train --metrics` file?".into(),
            ));
        }
        Ok(history)
    }

    /// Draws both curves against the step into a PNG of `width` x `height`
    /// pixels.
    pub fn plot(&self, path: &Path, title: &str) -> Result<(), TrainError> {
        let bad = |detail: String| TrainError::Data {
            path: path.to_path_buf(),
            detail,
        };
        register_font().map_err(bad)?;
        let draw = || -> Result<(), Box<dyn std::error::Error>> {
            let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
            root.fill(&WHITE)?;
            let points = self.train.iter().chain(&self.validation);
            let finite = |v: &&(u64, f64)| v.1.is_finite();
            let (min_step, max_step) = points
                .clone()
                .filter(finite)
                .fold((u64::MAX, 0), |(lo, hi), (s, _)| (lo.min(*s), hi.max(*s)));
            let (min_loss, max_loss) = points
                .filter(finite)
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, l)| {
                    (lo.min(*l), hi.max(*l))
                });
            if min_step > max_step {
                return Err("no finite loss to draw".into());
            }
            let pad = ((max_loss - min_loss) * 0.05).max(1e-3);
            let mut chart = ChartBuilder::on(&root)
                .caption(title, (FONT, 26))
                .margin(20)
                .x_label_area_size(50)
                .y_label_area_size(70)
                .build_cartesian_2d(
                    min_step..max_step.max(min_step + 1),
                    (min_loss - pad).max(0.0)..max_loss + pad,
                )?;
            chart
                .configure_mesh()
                .x_desc("step")
                .y_desc("loss (cross-entropy, nats)")
                .label_style((FONT, 16))
                .axis_desc_style((FONT, 18))
                .draw()?;
            let train_color = RGBColor(31, 119, 180);
            let validation_color = RGBColor(214, 39, 40);
            chart
                .draw_series(LineSeries::new(
                    self.train.iter().copied().filter(|p| p.1.is_finite()),
                    train_color.stroke_width(2),
                ))?
                .label("train")
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], train_color.stroke_width(3))
                });
            if !self.validation.is_empty() {
                let points = self.validation.iter().copied().filter(|p| p.1.is_finite());
                chart
                    .draw_series(LineSeries::new(
                        points.clone(),
                        validation_color.stroke_width(2),
                    ))?
                    .label("validation")
                    .legend(move |(x, y)| {
                        PathElement::new(
                            vec![(x, y), (x + 20, y)],
                            validation_color.stroke_width(3),
                        )
                    });
                chart.draw_series(points.map(|p| Circle::new(p, 4, validation_color.filled())))?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font((FONT, 18))
                .position(SeriesLabelPosition::UpperRight)
                .draw()?;
            root.present()?;
            Ok(())
        };
        draw().map_err(|e| bad(format!("cannot draw the loss plot: {e}")))
    }
}

/// The family name the plots ask for; [`register_font`] provides it.
const FONT: &str = "sans-serif";

/// Hands plotters the embedded font once per process (it keeps a global
/// table of fonts by name).
fn register_font() -> Result<(), String> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font(
            FONT,
            FontStyle::Normal,
            epaint_default_fonts::UBUNTU_LIGHT,
        )
        .map_err(|_| "the embedded font did not load".to_string());
    });
    result
}
