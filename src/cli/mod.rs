//! Command-line interface: clap parsing, human and `--json` output, exit
//! codes. Only this layer prints; the library returns values and errors.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod debug;
mod maint;
mod progress;
mod remote;
mod repo;
mod watch;

/// Exit codes, fixed so scripts can tell failures apart.
pub mod exit {
    pub const OK: u8 = 0;
    /// Bad input or a failed operation the user can fix.
    pub const USER: u8 = 1;
    // 2: command-line usage error (clap exits with it on its own).
    /// Stored or supplied data is corrupt.
    pub const CORRUPT: u8 = 3;
    /// Another ckvc process holds the repository's write lock.
    pub const LOCKED: u8 = 4;
}

#[derive(Parser)]
#[command(
    name = "ckvc",
    version,
    about = "Version control for deep-learning training checkpoints"
)]
struct Cli {
    #[command(flatten)]
    at: repo::Where,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Repo(repo::RepoCommand),
    #[command(flatten)]
    Maint(maint::MaintCommand),
    #[command(flatten)]
    Remote(remote::RemoteCommand),
    /// Developer tools: benchmarks and inspection.
    #[command(subcommand)]
    Debug(debug::DebugCommand),
}

/// An error rendered for the user: its kind (from the exit code), the
/// message, the chain of causes and a hint. Printed as
///
/// ```text
/// error[corrupt]: chunk 3632c89a351f of tensor w in model.safetensors (...) is corrupt: ...
///   caused by: ...
/// hint: run `ckvc fsck` ...
/// ```
pub struct Failure {
    pub code: u8,
    pub message: String,
    /// The error's sources, outermost first, leaving out each one the
    /// message above it already ends with (most library errors name their
    /// cause in their own message).
    pub causes: Vec<String>,
    pub hint: Option<String>,
}

impl Failure {
    pub fn user(message: impl Into<String>) -> Self {
        Failure {
            code: exit::USER,
            message: message.into(),
            causes: Vec::new(),
            hint: None,
        }
    }

    /// The failure for library error `e`, with its cause chain.
    pub fn from_error(code: u8, e: &dyn std::error::Error, hint: Option<String>) -> Self {
        let message = e.to_string();
        let mut causes = Vec::new();
        let mut above = message.clone();
        let mut next = e.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            if !above.ends_with(&text) {
                causes.push(text.clone());
            }
            above = text;
            next = cause.source();
        }
        Failure {
            code,
            message,
            causes,
            hint,
        }
    }

    /// What kind of failure, as the first word of the error line shows it.
    fn kind(&self) -> &'static str {
        match self.code {
            exit::CORRUPT => "error[corrupt]",
            exit::LOCKED => "error[busy]",
            _ => "error",
        }
    }

    /// The lines printed on stderr.
    fn render(&self) -> String {
        let mut s = format!("{}: {}\n", self.kind(), escape_controls(&self.message));
        for c in &self.causes {
            s.push_str(&format!("  caused by: {}\n", escape_controls(c)));
        }
        if let Some(h) = &self.hint {
            s.push_str(&format!("hint: {}\n", escape_controls(h)));
        }
        s
    }
}

/// `s` with every control character but newline and tab escaped (`\u{1b}`),
/// so commit messages, paths and tensor names read from checkpoints cannot
/// send escape sequences to the terminal.
pub fn escape_controls(s: &str) -> std::borrow::Cow<'_, str> {
    let bad = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !s.chars().any(bad) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if bad(c) {
            o.push_str(&c.escape_unicode().to_string());
        } else {
            o.push(c);
        }
    }
    std::borrow::Cow::Owned(o)
}

/// Write `v` as one pretty-printed JSON document on stdout (`--json`).
pub fn out_json<T: serde::Serialize + ?Sized>(v: &T) -> Result<(), Failure> {
    let s =
        serde_json::to_string_pretty(v).map_err(|e| Failure::user(format!("writing JSON: {e}")))?;
    write_raw(&(s + "\n"))
}

/// Write `v` as one line of JSON on stdout (streams: one object per event).
pub fn out_json_line<T: serde::Serialize + ?Sized>(v: &T) -> Result<(), Failure> {
    let s = serde_json::to_string(v).map_err(|e| Failure::user(format!("writing JSON: {e}")))?;
    write_raw(&(s + "\n"))
}

/// Write to stdout (control characters escaped, see [`escape_controls`]);
/// a closed pipe (`ckvc ... | head`) is not an error.
pub fn out(s: &str) -> Result<(), Failure> {
    write_raw(&escape_controls(s))
}

/// Write to stdout as is; a closed pipe is not an error.
fn write_raw(s: &str) -> Result<(), Failure> {
    let mut o = std::io::stdout().lock();
    match o.write_all(s.as_bytes()).and_then(|_| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Failure::user(format!("writing output: {e}"))),
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    ckvc::store::raise_open_file_limit();
    let result = match cli.command {
        Command::Repo(cmd) => repo::run(cmd, &cli.at),
        Command::Maint(cmd) => maint::run(cmd, &cli.at),
        Command::Remote(cmd) => remote::run(cmd, &cli.at),
        Command::Debug(cmd) => debug::run(cmd, cli.at.memory_budget),
    };
    match result {
        Ok(()) => ExitCode::from(exit::OK),
        Err(f) => {
            eprint!("{}", f.render());
            ExitCode::from(f.code)
        }
    }
}

/// Raises this process's soft limit on open files to its hard limit.
///
#[cfg(test)]
mod tests {
    use super::escape_controls;

    /// Every subcommand, flag and argument of every command has a line of
    /// help (issue 20: `remote add NAME URL`, `clone DIR` had none).
    #[test]
    fn every_command_flag_and_argument_has_help() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                let p = format!("{path} {}", sub.get_name());
                if sub.get_about().is_none() && sub.get_long_about().is_none() {
                    missing.push(p.clone());
                }
                walk(sub, &p, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&super::Cli::command(), "ckvc", &mut missing);
        assert!(missing.is_empty(), "no help for: {missing:#?}");
    }

    /// A failure renders its kind, message, the causes its message does
    /// not already name, and its hint.
    #[test]
    fn failures_render_kind_message_cause_chain_and_hint() {
        #[derive(Debug, thiserror::Error)]
        #[error("reading {0}")]
        struct Outer(&'static str, #[source] std::io::Error);
        #[derive(Debug, thiserror::Error)]
        #[error("x: {0}")]
        struct Embeds(#[source] std::io::Error);
        let io = || std::io::Error::other("disk on fire");
        let f = super::Failure::from_error(
            super::exit::CORRUPT,
            &Outer("a.bin", io()),
            Some("try again".into()),
        );
        assert_eq!(
            f.render(),
            "error[corrupt]: reading a.bin\n  caused by: disk on fire\nhint: try again\n"
        );
        // A cause the message already ends with is not repeated.
        let f = super::Failure::from_error(super::exit::USER, &Embeds(io()), None);
        assert_eq!(f.render(), "error: x: disk on fire\n");
        let f = super::Failure::from_error(super::exit::LOCKED, &Embeds(io()), None);
        assert!(f.render().starts_with("error[busy]: "));
    }

    /// `ckvc help <command>` gives an example for every user command
    /// (issue 20); the developer tools under `debug` are exempt.
    #[test]
    fn every_command_help_has_an_example() {
        use clap::CommandFactory;
        let cli = super::Cli::command();
        let missing: Vec<&str> = cli
            .get_subcommands()
            .filter(|c| c.get_name() != "debug")
            .filter(|c| {
                let long = c
                    .get_long_about()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                !long.contains("Example")
            })
            .map(|c| c.get_name())
            .collect();
        assert!(missing.is_empty(), "no example in the help of: {missing:?}");
    }

    #[test]
    fn escape_sequences_in_output_are_escaped() {
        assert_eq!(escape_controls("plain\ttext\n"), "plain\ttext\n");
        assert_eq!(
            escape_controls("evil\u{1b}[2J\r\u{7}x"),
            "evil\\u{1b}[2J\\u{d}\\u{7}x"
        );
        assert_eq!(escape_controls("c1 \u{9b}31m"), "c1 \\u{9b}31m");
    }
}
