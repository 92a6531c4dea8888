//! A remote in an S3-compatible bucket, through the `object_store` crate.
//!
//! Packs are plain PUTs (multipart above [`MULTIPART_ABOVE`]); refs change
//! with conditional PUTs (`If-None-Match: *` to create, `If-Match: <etag>`
//! to update: `S3ConditionalPut::ETagMatch`), which S3, R2, MinIO and moto
//! apply atomically. `object_store` is async: each call runs on a private
//! current-thread tokio runtime, so the rest of ckvc stays synchronous.

use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, S3ConditionalPut};
use object_store::path::Path as OsPath;
use object_store::{
    ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig, UpdateVersion,
};

use super::aws_files::SharedConfig;
use super::{check_key, Remote, RemoteError, Version};

/// Bodies larger than this go up as multipart uploads.
const MULTIPART_ABOVE: usize = 32 << 20;
const PART_BYTES: usize = 16 << 20;

/// S3 settings beyond the URL. Unset fields come from the standard AWS
/// environment variables (`AWS_ENDPOINT_URL`/`AWS_ENDPOINT`, `AWS_REGION`,
/// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, ...),
/// else from the AWS shared files (`~/.aws/credentials`, `~/.aws/config`,
/// profile `AWS_PROFILE`).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct S3Options {
    /// A self-hosted store's endpoint, e.g. `http://127.0.0.1:9000`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Credentials; never stored in the repository's config.
    #[serde(skip)]
    pub access_key_id: Option<String>,
    #[serde(skip)]
    pub secret_access_key: Option<String>,
}

/// A file's bytes and its ETag, if the server sent one.
type Fetched = (Vec<u8>, Option<String>);

/// A remote under `s3://bucket/prefix`.
pub struct S3Remote {
    store: Arc<dyn ObjectStore>,
    rt: tokio::runtime::Runtime,
    bucket: String,
    prefix: String,
}

impl std::fmt::Debug for S3Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url())
    }
}

impl S3Remote {
    pub fn new(bucket: &str, prefix: &str, opts: &S3Options) -> Result<S3Remote, RemoteError> {
        let url = format!("s3://{bucket}/{prefix}");
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_conditional_put(S3ConditionalPut::ETagMatch)
            .with_retry(RetryConfig {
                max_retries: 4,
                retry_timeout: Duration::from_secs(60),
                ..RetryConfig::default()
            });
        // What the environment does not say, the AWS shared files may.
        let unset = |vars: &[&str]| vars.iter().all(|v| std::env::var_os(v).is_none());
        let shared = SharedConfig::load();
        if unset(&["AWS_REGION", "AWS_DEFAULT_REGION"]) {
            b = b.with_region(shared.region.as_deref().unwrap_or("us-east-1"));
        }
        if unset(&["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]) {
            if let (Some(k), Some(s)) = (&shared.access_key_id, &shared.secret_access_key) {
                b = b.with_access_key_id(k).with_secret_access_key(s);
                if let Some(t) = &shared.session_token {
                    b = b.with_token(t);
                }
            }
        }
        let endpoint = opts.endpoint.clone().or_else(|| {
            unset(&["AWS_ENDPOINT_URL", "AWS_ENDPOINT"])
                .then(|| shared.endpoint_url.clone())
                .flatten()
        });
        if let Some(e) = &endpoint {
            b = b
                .with_endpoint(e.clone())
                .with_allow_http(e.starts_with("http://"))
                // Self-hosted stores rarely have per-bucket DNS names.
                .with_virtual_hosted_style_request(false);
        }
        if let Some(r) = &opts.region {
            b = b.with_region(r.clone());
        }
        if let Some(k) = &opts.access_key_id {
            b = b.with_access_key_id(k.clone());
        }
        if let Some(s) = &opts.secret_access_key {
            b = b.with_secret_access_key(s.clone());
        }
        let store = b.build().map_err(|e| RemoteError::BadUrl {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| RemoteError::Io {
                what: "starting the S3 client runtime".into(),
                source,
            })?;
        Ok(S3Remote {
            store: Arc::new(store),
            rt,
            bucket: bucket.into(),
            prefix: prefix.trim_end_matches('/').into(),
        })
    }

    fn path(&self, key: &str) -> Result<OsPath, RemoteError> {
        check_key(key)?;
        Ok(OsPath::from(self.full(key)))
    }

    fn full(&self, key: &str) -> String {
        if self.prefix.is_empty() {
            key.to_string()
        } else {
            format!("{}/{key}", self.prefix)
        }
    }

    fn err(&self, key: &str, e: object_store::Error) -> RemoteError {
        match e {
            object_store::Error::Precondition { .. }
            | object_store::Error::AlreadyExists { .. } => {
                RemoteError::Conflict { key: key.into() }
            }
            e => {
                let mut reason = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    let s_str = s.to_string();
                    if !reason.contains(&s_str) {
                        reason.push_str(": ");
                        reason.push_str(&s_str);
                    }
                    src = s.source();
                }
                RemoteError::Backend {
                    what: format!("s3://{}/{}", self.bucket, self.full(key)),
                    reason,
                }
            }
        }
    }

    /// The bytes and ETag of a file.
    fn fetch(&self, key: &str) -> Result<Option<Fetched>, RemoteError> {
        let path = self.path(key)?;
        self.rt.block_on(async {
            match self.store.get(&path).await {
                Ok(r) => {
                    let etag = r.meta.e_tag.clone();
                    let bytes = r.bytes().await.map_err(|e| self.err(key, e))?;
                    Ok(Some((bytes.to_vec(), etag)))
                }
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.err(key, e)),
            }
        })
    }
}

impl Remote for S3Remote {
    fn url(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, RemoteError> {
        Ok(self.fetch(key)?.map(|(b, _)| b))
    }

    fn get_limited(&self, key: &str, max: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        let path = self.path(key)?;
        self.rt.block_on(async {
            match self.store.get(&path).await {
                // The object's size is known before its body is read.
                Ok(r) if r.meta.size > max => Err(RemoteError::TooLarge {
                    key: key.into(),
                    len: r.meta.size,
                    limit: max,
                }),
                Ok(r) => {
                    let bytes = r.bytes().await.map_err(|e| self.err(key, e))?;
                    Ok(Some(bytes.to_vec()))
                }
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.err(key, e)),
            }
        })
    }

    fn get_range(&self, key: &str, start: u64, len: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        let path = self.path(key)?;
        let end = super::range_end(key, start, len)?;
        self.rt.block_on(async {
            if len == 0 {
                return match self.store.head(&path).await {
                    Ok(_) => Ok(Some(Vec::new())),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(self.err(key, e)),
                };
            }
            match self.store.get_range(&path, start..end).await {
                // A server that sends another length is not trusted.
                Ok(b) if b.len() as u64 == len => Ok(Some(b.to_vec())),
                Ok(b) => Err(super::short_file(key, start + b.len() as u64, end)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.err(key, e)),
            }
        })
    }

    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, Version)>, RemoteError> {
        match self.fetch(key)? {
            None => Ok(None),
            Some((b, Some(etag))) => Ok(Some((b, Version(etag)))),
            Some((_, None)) => Err(RemoteError::Backend {
                what: format!("s3://{}/{}", self.bucket, self.full(key)),
                reason: "the server sent no ETag, so refs cannot be updated safely".into(),
            }),
        }
    }

    fn put(&self, key: &str, data: Vec<u8>) -> Result<(), RemoteError> {
        let path = self.path(key)?;
        self.rt.block_on(async {
            if data.len() <= MULTIPART_ABOVE {
                return self
                    .store
                    .put(&path, PutPayload::from(data))
                    .await
                    .map(|_| ())
                    .map_err(|e| self.err(key, e));
            }
            let mut up = self
                .store
                .put_multipart(&path)
                .await
                .map_err(|e| self.err(key, e))?;
            for part in data.chunks(PART_BYTES) {
                if let Err(e) = up.put_part(PutPayload::from(part.to_vec())).await {
                    let _ = up.abort().await;
                    return Err(self.err(key, e));
                }
            }
            up.complete()
                .await
                .map(|_| ())
                .map_err(|e| self.err(key, e))
        })
    }

    fn put_if(
        &self,
        key: &str,
        data: Vec<u8>,
        expected: Option<&Version>,
    ) -> Result<(), RemoteError> {
        let path = self.path(key)?;
        let mode = match expected {
            None => PutMode::Create,
            Some(v) => PutMode::Update(UpdateVersion {
                e_tag: Some(v.0.clone()),
                version: None,
            }),
        };
        let opts = PutOptions {
            mode,
            ..PutOptions::default()
        };
        self.rt.block_on(async {
            self.store
                .put_opts(&path, PutPayload::from(data), opts)
                .await
                .map(|_| ())
                .map_err(|e| match e {
                    // A conditional update of a file deleted meanwhile.
                    object_store::Error::NotFound { .. } => {
                        RemoteError::Conflict { key: key.into() }
                    }
                    e => self.err(key, e),
                })
        })
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>, RemoteError> {
        let dir = prefix.trim_end_matches('/');
        let full = if dir.is_empty() {
            self.prefix.clone()
        } else {
            self.full(dir)
        };
        let os_prefix = (!full.is_empty()).then(|| OsPath::from(full.as_str()));
        let strip = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let metas: Vec<object_store::ObjectMeta> = self.rt.block_on(async {
            self.store
                .list(os_prefix.as_ref())
                .try_collect()
                .await
                .map_err(|e| self.err(prefix, e))
        })?;
        let mut out: Vec<String> = metas
            .into_iter()
            .filter_map(|m| m.location.as_ref().strip_prefix(&strip).map(str::to_string))
            .filter(|k| k.starts_with(prefix))
            .collect();
        out.sort();
        Ok(out)
    }

    fn delete(&self, key: &str) -> Result<(), RemoteError> {
        let path = self.path(key)?;
        self.rt.block_on(async {
            match self.store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(self.err(key, e)),
            }
        })
    }
}
