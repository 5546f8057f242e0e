//! `--config FILE`: the trainer's flags from a TOML file, under those of
//! the command line.

use super::{Args, TrainError};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, CommandFactory, FromArgMatches};
use std::any::TypeId;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use toml::Value;

impl Args {
    /// Parses `argv` (the program's name first) and fills the flags it
    /// does not give from the file of its `--config`, if any.
    ///
    /// The file's keys are the long flag names (`world-size = 2`;
    /// `world_size` is read as the same key). Each entry becomes a
    /// `--name=value` argument for the same clap parser the command line
    /// goes through, so every flag is read, checked and defaulted in one
    /// place; an entry whose flag the command line gives (by clap's
    /// `ValueSource::CommandLine`, so also one given with its default
    /// value) is left out.
    ///
    /// Errors: `TrainError::CommandLine` for a command line clap rejects
    /// (or `--help`), `TrainError::Usage` naming the file and the key for
    /// an unreadable file, an unknown key or a value of the wrong type.
    pub fn parse_with_config<I, T>(argv: I) -> Result<Self, TrainError>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        let mut argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
        let command_line = Args::command().try_get_matches_from(&argv)?;
        if let Some(path) = command_line.get_one::<PathBuf>("config") {
            argv.extend(file_arguments(path, &command_line)?);
        }
        let matches = Args::command().try_get_matches_from(argv)?;
        Ok(Args::from_arg_matches(&matches)?)
    }
}

/// The `--name=value` arguments of the file's entries whose flags the
/// command line does not give, sorted by key.
fn file_arguments(path: &Path, command_line: &ArgMatches) -> Result<Vec<OsString>, TrainError> {
    let usage =
        |detail: String| TrainError::Usage(format!("--config {}: {detail}", path.display()));
    let text = std::fs::read_to_string(path)
        .map_err(|e| usage(format!("cannot read it ({e}); check the path")))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| usage(format!("not a TOML file: {e}")))?;
    let command = Args::command();
    let mut keys_by_flag = BTreeMap::new();
    let mut arguments = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        if long == "config" {
            return Err(usage(format!(
                "`{key}` names another file; a config file cannot include one: merge the two, or \
                 give the other flags on the command line"
            )));
        }
        let arg = command
            .get_arguments()
            .find(|arg| arg.get_long() == Some(long.as_str()) && is_a_setting(arg))
            .ok_or_else(|| {
                usage(format!(
                    "unknown key `{key}`; the keys are the long flags of `train --help` without \
                     their dashes, e.g. `world-size = 2`"
                ))
            })?;
        if let Some(first) = keys_by_flag.insert(long.clone(), key) {
            return Err(usage(format!(
                "`{first}` and `{key}` are the same flag --{long}; give it once"
            )));
        }
        let entry = format!("`{key} = {value}`");
        let argument = argument(arg, &long, value).map_err(|e| usage(format!("{entry}: {e}")))?;
        // Parsed on its own, so that a value clap rejects is blamed on its
        // entry, even where the command line then overrides it.
        if let Some(argument) = &argument {
            if let Err(e) = Args::command().try_get_matches_from(["train", argument]) {
                return Err(usage(format!("{entry}: {}", clap_message(&e))));
            }
        }
        if command_line.value_source(arg.get_id().as_str()) != Some(ValueSource::CommandLine) {
            arguments.extend(argument.map(OsString::from));
        }
    }
    Ok(arguments)
}

/// Whether `arg` is one of the trainer's settings (not clap's `--help`,
/// `--version`).
fn is_a_setting(arg: &Arg) -> bool {
    !matches!(
        arg.get_action(),
        ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
    )
}

/// What a flag's values are, as a TOML file writes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `true` or `false`.
    Boolean,
    /// An integer, or for a float flag also a float; clap checks the range.
    Number,
    /// A name (`--optimizer`) or a path.
    Text,
    /// Free text that may be a number (`--loss-scale 1024`, `--prompt`).
    TextOrNumber,
}

impl Kind {
    fn of(arg: &Arg) -> Kind {
        if matches!(arg.get_action(), ArgAction::SetTrue) {
            return Kind::Boolean;
        }
        let type_id = arg.get_value_parser().type_id();
        let numbers = [
            TypeId::of::<u8>(),
            TypeId::of::<u64>(),
            TypeId::of::<usize>(),
            TypeId::of::<f64>(),
        ];
        if type_id == TypeId::of::<bool>() {
            Kind::Boolean
        } else if numbers.iter().any(|n| type_id == *n) {
            Kind::Number
        } else if type_id == TypeId::of::<String>() {
            Kind::TextOrNumber
        } else {
            Kind::Text
        }
    }

    /// How the command line spells `value`, if it is of this kind.
    fn spell(self, value: &Value) -> Option<String> {
        match (self, value) {
            (Kind::Boolean, Value::Boolean(b)) => Some(b.to_string()),
            (Kind::Text | Kind::TextOrNumber, Value::String(s)) => Some(s.clone()),
            (Kind::Number | Kind::TextOrNumber, Value::Integer(i)) => Some(i.to_string()),
            // `Display` writes the shortest text that parses back to `f`.
            (Kind::Number | Kind::TextOrNumber, Value::Float(f)) => Some(f.to_string()),
            _ => None,
        }
    }

    fn expected(self) -> &'static str {
        match self {
            Kind::Boolean => "true or false",
            Kind::Number => "a number",
            Kind::Text => "a string",
            Kind::TextOrNumber => "a string or a number",
        }
    }
}

/// The command-line argument of `--long` set to `value`: `--long=value`,
/// the list flags' values joined by their delimiter, a switch's bare name
/// when true and nothing when false.
fn argument(arg: &Arg, long: &str, value: &Value) -> Result<Option<String>, String> {
    let kind = Kind::of(arg);
    let wrong = |v: &Value| {
        format!(
            "--{long} takes {}, not a TOML {}",
            kind.expected(),
            v.type_str()
        )
    };
    match (value, arg.get_value_delimiter()) {
        (Value::Array(items), Some(delimiter)) => {
            let spelled = items
                .iter()
                .map(|item| kind.spell(item).ok_or_else(|| wrong(item)))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Some(format!(
                "--{long}={}",
                spelled.join(&delimiter.to_string())
            )))
        }
        (Value::Array(_), None) => Err(format!("--{long} takes one value, not a TOML array")),
        (value, _) => {
            let spelled = kind.spell(value).ok_or_else(|| wrong(value))?;
            Ok(match arg.get_action() {
                ArgAction::SetTrue if spelled == "true" => Some(format!("--{long}")),
                ArgAction::SetTrue => None,
                _ => Some(format!("--{long}={spelled}")),
            })
        }
    }
}

/// Clap's message on one line, without its `error: `, usage and help
/// hint.
fn clap_message(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let lines: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more"))
        .collect();
    let message = lines.join(" ");
    message
        .strip_prefix("error: ")
        .unwrap_or(&message)
        .to_string()
}
