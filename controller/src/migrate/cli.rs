//! `kubectl tessera migrate -f FILE|-`: the translated documents to stdout, the report to stderr.

use std::io::{Read, Write};
use std::path::PathBuf;

use super::{MigrateError, Options, mig::MigModel, migrate};

/// The exit codes, shown in `--help`.
pub const EXIT_CODES: &str = "\
Exit status: 0 when the input was read (whether or not everything could be translated: the report on \
stderr lists what was not, each line starting with NOT TRANSLATED), 2 when the input cannot be read or \
is not YAML.";

/// Flags of `kubectl tessera migrate`.
#[derive(Debug, Clone, clap::Args)]
pub struct MigrateArgs {
    /// YAML file of one or more documents written for NVIDIA's DRA driver or device plugin; `-` for stdin.
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,
    /// The GPU model MIG profile names are rewritten for (a profile of another model becomes the one with
    /// as many memory slices).
    #[arg(long, value_enum, default_value = "h100-80gb")]
    pub mig_model: MigModel,
}

fn read(path: &std::path::Path) -> Result<(String, String), MigrateError> {
    let err = |e: std::io::Error| MigrateError::Read {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).map_err(err)?;
        return Ok((text, "<stdin>".into()));
    }
    Ok((
        std::fs::read_to_string(path).map_err(err)?,
        path.display().to_string(),
    ))
}

/// Runs the subcommand; the exit code.
pub fn run(args: &MigrateArgs) -> u8 {
    let result = read(&args.file).and_then(|(text, source)| {
        migrate(
            &text,
            &source,
            Options {
                target: args.mig_model,
            },
        )
    });
    match result {
        Ok(m) => {
            // A closed stdout (`| head`) is not an error of the translation.
            let _ = std::io::stdout().write_all(m.yaml.as_bytes());
            eprint!("{}", m.report());
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}
