//! The AWS shared configuration files, for S3 settings the environment does
//! not give: `~/.aws/credentials` and `~/.aws/config` (or the files named by
//! `AWS_SHARED_CREDENTIALS_FILE` / `AWS_CONFIG_FILE`), profile `AWS_PROFILE`
//! (default `default`). Read: `aws_access_key_id`, `aws_secret_access_key`,
//! `aws_session_token`, `region`, `endpoint_url` (nested per-service
//! settings are skipped). Precedence, as in the AWS CLI:
//! explicit options, then environment variables, then these files, and in
//! them the credentials file before the config file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What the shared files say for one profile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedConfig {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
}

impl SharedConfig {
    /// From the standard locations and the environment's profile; missing
    /// or unreadable files give nothing.
    pub fn load() -> SharedConfig {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let file = |var: &str, name: &str| {
            std::env::var_os(var)
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
        };
        let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".into());
        Self::from_files(
            file("AWS_SHARED_CREDENTIALS_FILE", "credentials").as_deref(),
            file("AWS_CONFIG_FILE", "config").as_deref(),
            &profile,
        )
    }

    /// From the given files (either may be absent) for `profile`.
    pub fn from_files(credentials: Option<&Path>, config: Option<&Path>, profile: &str) -> Self {
        let read = |p: Option<&Path>| {
            p.and_then(|p| std::fs::read_to_string(p).ok())
                .map(|t| parse_ini(&t))
                .unwrap_or_default()
        };
        let creds = read(credentials);
        let conf = read(config);
        // The credentials file names sections by the bare profile; the
        // config file says `[profile NAME]`, except for `[default]`.
        let empty = HashMap::new();
        let c = creds.get(profile).unwrap_or(&empty);
        let f = conf
            .get(&format!("profile {profile}"))
            .or_else(|| {
                (profile == "default")
                    .then(|| conf.get("default"))
                    .flatten()
            })
            .unwrap_or(&empty);
        let get = |k: &str| c.get(k).or_else(|| f.get(k)).cloned();
        SharedConfig {
            access_key_id: get("aws_access_key_id"),
            secret_access_key: get("aws_secret_access_key"),
            session_token: get("aws_session_token"),
            region: get("region"),
            endpoint_url: get("endpoint_url"),
        }
    }
}

/// `[section]` headers and `key = value` lines; `#` and `;` start comments;
/// indented lines (sub-settings) are skipped.
fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut section: Option<String> = None;
    for line in text.lines() {
        if line.starts_with([' ', '\t']) {
            continue;
        }
        let line = line.trim();
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            out.entry(name.clone()).or_default();
            section = Some(name);
        } else if let (Some(s), Some((k, v))) = (&section, line.split_once('=')) {
            out.entry(s.clone())
                .or_default()
                .insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_from_both_files_with_credentials_first() {
        let d = tempfile::tempdir().unwrap();
        let creds = d.path().join("credentials");
        let conf = d.path().join("config");
        std::fs::write(
            &creds,
            "# comment\n[default]\naws_access_key_id = AK1\naws_secret_access_key=SK1\n\n[work]\naws_access_key_id = AK2\naws_secret_access_key = SK2\naws_session_token = T2\n",
        )
        .unwrap();
        std::fs::write(
            &conf,
            "[default]\nregion = eu-west-1\n[profile  work]\nregion = us-west-2\nendpoint_url = http://127.0.0.1:9000\naws_access_key_id = IGNORED\ns3 =\n  addressing_style = path\n",
        )
        .unwrap();
        let d1 = SharedConfig::from_files(Some(&creds), Some(&conf), "default");
        assert_eq!(d1.access_key_id.as_deref(), Some("AK1"));
        assert_eq!(d1.secret_access_key.as_deref(), Some("SK1"));
        assert_eq!(d1.region.as_deref(), Some("eu-west-1"));
        assert_eq!(d1.endpoint_url, None);
        let w = SharedConfig::from_files(Some(&creds), Some(&conf), "work");
        assert_eq!(w.access_key_id.as_deref(), Some("AK2"));
        assert_eq!(w.session_token.as_deref(), Some("T2"));
        assert_eq!(w.region.as_deref(), Some("us-west-2"));
        assert_eq!(w.endpoint_url.as_deref(), Some("http://127.0.0.1:9000"));
        let none = SharedConfig::from_files(Some(&d.path().join("nope")), None, "default");
        assert_eq!(none, SharedConfig::default());
    }
}
