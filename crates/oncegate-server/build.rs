//! Records the git commit the server is built from, for `oncegate --version` and the
//! `oncegate_build_info` metric. Outside a git checkout (a source tarball) it is
//! `unknown`; `ONCEGATE_GIT_COMMIT` in the build's environment overrides both.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=ONCEGATE_GIT_COMMIT");
    // The commit changes when HEAD moves or the branch it names advances.
    for path in ["../../.git/HEAD", "../../.git/refs/heads", "../../.git/packed-refs"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let commit =
        std::env::var("ONCEGATE_GIT_COMMIT").ok().or_else(git_commit).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=ONCEGATE_GIT_COMMIT={commit}");
}

fn git_commit() -> Option<String> {
    let out = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).output().ok()?;
    let commit = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !commit.is_empty()).then_some(commit)
}
