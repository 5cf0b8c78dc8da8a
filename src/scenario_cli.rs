//! What `geo simulate` and `balance simulate` share: read a scenario file, run it, draw it,
//! print it.

use std::path::Path;

use anyhow::Context;
use serde::Serialize;

/// A simulator as the command line drives it.
pub(crate) struct Simulator<R> {
    /// Parses and runs the scenario text.
    pub run: fn(&str) -> anyhow::Result<R>,
    pub svg: fn(&R) -> anyhow::Result<String>,
    pub text: fn(&R) -> String,
}

impl<R: Serialize> Simulator<R> {
    /// Runs the scenario at `path`; draws it into `svg` if asked; prints the report as JSON or
    /// text.
    pub(crate) fn simulate(
        &self,
        path: &Path,
        json: bool,
        svg: Option<&Path>,
    ) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading scenario {}", path.display()))?;
        let report = (self.run)(&text).with_context(|| format!("scenario {}", path.display()))?;
        if let Some(out) = svg {
            let plot = (self.svg)(&report)?;
            std::fs::write(out, plot).with_context(|| format!("writing {}", out.display()))?;
            eprintln!("plot written to {}", out.display());
        }
        if json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{}", (self.text)(&report));
        }
        Ok(())
    }
}
