//! A remote in an S3-compatible bucket, through the `object_store` crate.
//!
//! Packs are plain PUTs (multipart above [`MULTIPART_ABOVE`]); refs change
//! with conditional PUTs (`If-None-Match: *` to create, `If-Match: <etag>`
//! to update: `S3ConditionalPut::ETagMatch`), which S3, R2, MinIO and moto
//! apply atomically. `object_store` is async: each call runs on a private
//! current-thread tokio runtime, so the rest of ckvc stays synchronous.
//!
//! A request is given [`Timeouts::request`] (30 s) and retried; one that
//! carries a body of more than [`BULK_ABOVE`] bytes goes through a second
//! client without that limit and is given 30 s plus a second for each
//! [`Timeouts::rate`] bytes (128 KiB) of its body instead, so a pack goes
//! up and comes down over a slow link and a stalled transfer still ends.

use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, S3ConditionalPut};
use object_store::path::Path as OsPath;
use object_store::ClientConfigKey;
use object_store::{
    GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig,
    UpdateVersion,
};

use super::aws_files::SharedConfig;
use super::{check_key, Remote, RemoteError, Version};

/// Bodies larger than this go up as multipart uploads.
const MULTIPART_ABOVE: usize = 32 << 20;
const PART_BYTES: usize = 16 << 20;

/// No file of an S3 remote is read if larger than this (the largest pack
/// a reader accepts, `pack::MAX_PACK_BYTES`).
const MAX_FILE: u64 = super::pack::MAX_PACK_BYTES;

/// A body's buffer is allocated for at most this many bytes before they
/// arrive (it grows as they do).
const BODY_PREALLOC: u64 = 64 << 20;

/// Requests whose body (sent or asked for) is larger than this go through
/// the bulk client, timed by their size (see [`Timeouts`]).
const BULK_ABOVE: u64 = 1 << 20;

/// How long requests may take. The object store's own timeout ends every
/// request after `request`, and its retries try again: a 16-32 MiB body
/// needs 0.5-1.1 MB/s to get there in time, and an office uplink has
/// less. Bulk requests instead get `request` plus a second for each
/// `rate` bytes of their body, ending the transfer (not retried) when
/// that runs out.
#[derive(Debug, Clone, Copy)]
struct Timeouts {
    request: Duration,
    rate: u64,
}

impl Timeouts {
    const DEFAULT: Timeouts = Timeouts {
        request: Duration::from_secs(30),
        rate: 128 << 10,
    };

    /// The time a bulk request moving `bytes` is given.
    fn allow(&self, bytes: u64) -> Duration {
        self.request + Duration::from_secs_f64(bytes as f64 / self.rate as f64)
    }
}

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
    /// The same store through a client without a request timeout, for
    /// bodies above [`BULK_ABOVE`] (each timed by [`S3Remote::within`]).
    bulk: Arc<dyn ObjectStore>,
    timeouts: Timeouts,
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
        Self::with_timeouts(bucket, prefix, opts, Timeouts::DEFAULT)
    }

    fn with_timeouts(
        bucket: &str,
        prefix: &str,
        opts: &S3Options,
        timeouts: Timeouts,
    ) -> Result<S3Remote, RemoteError> {
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
        let timeout = |d: Duration| {
            (
                AmazonS3ConfigKey::Client(ClientConfigKey::Timeout),
                format!("{}ms", d.as_millis()),
            )
        };
        let build = |b: AmazonS3Builder, (k, v): (AmazonS3ConfigKey, String)| {
            b.with_config(k, v)
                .build()
                .map_err(|e| RemoteError::BadUrl {
                    url: url.clone(),
                    reason: e.to_string(),
                })
        };
        let store = build(b.clone(), timeout(timeouts.request))?;
        // The bulk client's own limit is beyond any `within` gives.
        let bulk = build(b, timeout(timeouts.allow(MAX_FILE) * 2))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| RemoteError::Io {
                what: "starting the S3 client runtime".into(),
                source,
            })?;
        Ok(S3Remote {
            store: Arc::new(store),
            bulk: Arc::new(bulk),
            timeouts,
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

    /// The client for a request moving `bytes`: the bulk one above
    /// [`BULK_ABOVE`].
    fn client(&self, bytes: u64) -> &Arc<dyn ObjectStore> {
        if bytes > BULK_ABOVE {
            &self.bulk
        } else {
            &self.store
        }
    }

    /// `f`, a request of the bulk client moving `bytes`, ended with an
    /// error when it takes longer than [`Timeouts::allow`] gives it; a
    /// request of the small client (`bulk` false) as it is, ended (and
    /// retried) by the client's own timeout.
    async fn within<T>(
        &self,
        key: &str,
        bulk: bool,
        bytes: u64,
        f: impl std::future::Future<Output = Result<T, RemoteError>>,
    ) -> Result<T, RemoteError> {
        if !bulk {
            return f.await;
        }
        let allowed = self.timeouts.allow(bytes);
        match tokio::time::timeout(allowed, f).await {
            Ok(r) => r,
            Err(_) => Err(RemoteError::Backend {
                what: format!("s3://{}/{}", self.bucket, self.full(key)),
                reason: format!(
                    "no answer within {:.0} s (a transfer of {bytes} bytes is given {} s \
                     and a second for each {} KiB)",
                    allowed.as_secs_f64(),
                    self.timeouts.request.as_secs(),
                    self.timeouts.rate >> 10
                ),
            }),
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

    /// The bytes and ETag of a file of at most `max` bytes.
    fn fetch(&self, key: &str, max: u64) -> Result<Option<Fetched>, RemoteError> {
        let path = self.path(key)?;
        self.rt.block_on(async {
            let head = async {
                match self.client(max).get(&path).await {
                    Ok(r) => Ok(Some(r)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(self.err(key, e)),
                }
            };
            let bulk = max > BULK_ABOVE;
            let Some(r) = self.within(key, bulk, 0, head).await? else {
                return Ok(None);
            };
            let etag = r.meta.e_tag.clone();
            let bytes = self.timed_body(key, bulk, r, max).await?;
            Ok(Some((bytes, etag)))
        })
    }

    /// [`S3Remote::body`], timed by the length the server declared (it is
    /// refused above `max` before anything is read).
    async fn timed_body(
        &self,
        key: &str,
        bulk: bool,
        r: object_store::GetResult,
        max: u64,
    ) -> Result<Vec<u8>, RemoteError> {
        let want = r.range.end.saturating_sub(r.range.start).min(max);
        self.within(key, bulk, want, self.body(key, r, max)).await
    }

    /// The body of a GET, in bounded memory whatever the server says: the
    /// length it declares (the object's, or the range's) must be at most
    /// `max`, checked before anything is read, and the body is read as a
    /// stream and refused as soon as it runs past that length (a server
    /// may send more than its Content-Length, or stream without end); a
    /// shorter body is refused too.
    async fn body(
        &self,
        key: &str,
        r: object_store::GetResult,
        max: u64,
    ) -> Result<Vec<u8>, RemoteError> {
        let want = r.range.end.saturating_sub(r.range.start);
        if want > max {
            return Err(RemoteError::TooLarge {
                key: key.into(),
                len: want,
                limit: max,
            });
        }
        let mut buf = Vec::with_capacity(want.min(BODY_PREALLOC) as usize);
        let mut stream = r.into_stream();
        while let Some(b) = stream.try_next().await.map_err(|e| self.err(key, e))? {
            if (buf.len() + b.len()) as u64 > want {
                return Err(RemoteError::Corrupt {
                    what: format!("s3://{}/{}", self.bucket, self.full(key)),
                    reason: format!("the server sent more than the {want} bytes it declared"),
                });
            }
            buf.extend_from_slice(&b);
        }
        if (buf.len() as u64) < want {
            return Err(RemoteError::Corrupt {
                what: format!("s3://{}/{}", self.bucket, self.full(key)),
                reason: format!(
                    "the server sent {} of the {want} bytes it declared",
                    buf.len()
                ),
            });
        }
        Ok(buf)
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
        Ok(self.fetch(key, MAX_FILE)?.map(|(b, _)| b))
    }

    fn get_limited(&self, key: &str, max: u64) -> Result<Option<Vec<u8>>, RemoteError> {
        Ok(self.fetch(key, max.min(MAX_FILE))?.map(|(b, _)| b))
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
            let opts = GetOptions::new().with_range(Some(start..end));
            let head = async {
                match self.client(len).get_opts(&path, opts).await {
                    Ok(r) => Ok(Some(r)),
                    Err(object_store::Error::NotFound { .. }) => Ok(None),
                    Err(e) => Err(self.err(key, e)),
                }
            };
            let bulk = len > BULK_ABOVE;
            match self.within(key, bulk, 0, head).await? {
                // A server that sends another length is not trusted.
                Some(r) if r.range != (start..end) => Err(super::short_file(key, r.range.end, end)),
                Some(r) => self.timed_body(key, bulk, r, len).await.map(Some),
                None => Ok(None),
            }
        })
    }

    fn get_versioned(&self, key: &str) -> Result<Option<(Vec<u8>, Version)>, RemoteError> {
        self.get_versioned_limited(key, MAX_FILE)
    }

    fn get_versioned_limited(
        &self,
        key: &str,
        max: u64,
    ) -> Result<Option<(Vec<u8>, Version)>, RemoteError> {
        match self.fetch(key, max.min(MAX_FILE))? {
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
        let len = data.len() as u64;
        self.rt.block_on(async {
            if data.len() <= MULTIPART_ABOVE {
                let put = async {
                    self.client(len)
                        .put(&path, PutPayload::from(data))
                        .await
                        .map(|_| ())
                        .map_err(|e| self.err(key, e))
                };
                return self.within(key, len > BULK_ABOVE, len, put).await;
            }
            let start = async {
                self.bulk
                    .put_multipart(&path)
                    .await
                    .map_err(|e| self.err(key, e))
            };
            let mut up = self.within(key, true, 0, start).await?;
            for part in data.chunks(PART_BYTES) {
                let sent = async {
                    up.put_part(PutPayload::from(part.to_vec()))
                        .await
                        .map_err(|e| self.err(key, e))
                };
                if let Err(e) = self.within(key, true, part.len() as u64, sent).await {
                    let _ = self
                        .within(key, true, 0, async { Ok(up.abort().await) })
                        .await;
                    return Err(e);
                }
            }
            let done = async { Ok(up.complete().await) };
            match self.within(key, true, 0, done).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => {
                    // An upload left open keeps its parts stored (and
                    // billed) until the bucket's lifecycle rules, if any,
                    // remove them.
                    let _ = self
                        .within(key, true, 0, async { Ok(up.abort().await) })
                        .await;
                    Err(self.err(key, e))
                }
                Err(e) => {
                    let _ = self
                        .within(key, true, 0, async { Ok(up.abort().await) })
                        .await;
                    Err(e)
                }
            }
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// A server on 127.0.0.1 that hands each connection to `conn`, in a
    /// thread of its own; its endpoint.
    fn serve(conn: impl Fn(TcpStream) + Send + Sync + 'static) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let conn = Arc::new(conn);
        std::thread::spawn(move || {
            for c in listener.incoming() {
                let Ok(c) = c else { return };
                let conn = conn.clone();
                std::thread::spawn(move || conn(c));
            }
        });
        endpoint
    }

    /// The head of the next request on `c` (up to its blank line, a byte
    /// at a time so its body stays in the stream), lowercased; None when
    /// the client is gone.
    fn read_head(c: &mut TcpStream) -> Option<String> {
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match c.read(&mut b) {
                Ok(0) | Err(_) => return None,
                Ok(_) => head.push(b[0]),
            }
        }
        Some(String::from_utf8_lossy(&head).to_ascii_lowercase())
    }

    /// The value of header `name` (lowercase, with its colon) in `head`.
    fn header(head: &str, name: &str) -> Option<String> {
        head.lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
    }

    /// A request's body length, from its head.
    fn content_length(head: &str) -> u64 {
        header(head, "content-length:")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// A hostile S3 server on 127.0.0.1: every request gets `head` (status
    /// line and headers) and then zeros, up to `body` bytes per response.
    /// Returns its endpoint and the body bytes it managed to send.
    fn hostile_server(head: &'static str, body: u64) -> (String, Arc<AtomicU64>) {
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let endpoint = serve(move |mut c| {
            let _ = c.set_write_timeout(Some(Duration::from_secs(2)));
            if read_head(&mut c).is_none() || c.write_all(head.as_bytes()).is_err() {
                return;
            }
            let zeros = vec![0u8; 64 << 10];
            let mut left = body;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                if c.write_all(&zeros[..n]).is_err() {
                    return;
                }
                counter.fetch_add(n as u64, Ordering::Relaxed);
                left -= n as u64;
            }
        });
        (endpoint, sent)
    }

    /// An S3 server that takes a multipart upload's parts but refuses to
    /// complete it (403); returns its endpoint and how many aborts (a
    /// DELETE with the upload id) it got.
    fn refusing_completion_server() -> (String, Arc<AtomicU64>) {
        let aborts = Arc::new(AtomicU64::new(0));
        let counter = aborts.clone();
        let endpoint = serve(move |mut c| loop {
            // One request: its head, then its body (Content-Length).
            let Some(head) = read_head(&mut c) else {
                return;
            };
            let len = content_length(&head);
            if std::io::copy(&mut (&mut c).take(len), &mut std::io::sink()).is_err() {
                return;
            }
            let line = head.lines().next().unwrap_or("").to_string();
            let (status, body) = if line.starts_with("post") && line.contains("?uploads") {
                ("200 OK", "<InitiateMultipartUploadResult><Bucket>bucket</Bucket><Key>p/k</Key><UploadId>u1</UploadId></InitiateMultipartUploadResult>")
            } else if line.starts_with("put") {
                ("200 OK", "")
            } else if line.starts_with("delete") && line.contains("uploadid=u1") {
                counter.fetch_add(1, Ordering::Relaxed);
                ("204 No Content", "")
            } else {
                (
                    "403 Forbidden",
                    "<Error><Code>AccessDenied</Code><Message>no</Message></Error>",
                )
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nETag: \"e\"\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            if c.write_all(resp.as_bytes()).is_err() {
                return;
            }
        });
        (endpoint, aborts)
    }

    #[test]
    fn a_multipart_upload_whose_completion_fails_is_aborted() {
        let (endpoint, aborts) = refusing_completion_server();
        let r = remote_at(endpoint);
        let e = r
            .put("packs/x.pack", vec![7u8; MULTIPART_ABOVE + 1])
            .unwrap_err();
        assert!(!matches!(e, RemoteError::TooLarge { .. }), "{e}");
        assert_eq!(aborts.load(Ordering::Relaxed), 1, "{e}");
    }

    fn remote_at(endpoint: String) -> S3Remote {
        slow_remote(endpoint, Timeouts::DEFAULT)
    }

    #[test]
    fn an_s3_range_body_longer_than_the_range_is_refused_without_reading_it() {
        // 41 bytes asked for; the server says so in Content-Range but
        // sends a 1 GiB body (64 MiB of it, per response).
        let (endpoint, sent) = hostile_server(
            "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 16-56/1000\r\n\
             Content-Length: 1073741824\r\nETag: \"e\"\r\n\
             Last-Modified: Sun, 29 Nov 2026 18:00:00 GMT\r\n\r\n",
            64 << 20,
        );
        let r = remote_at(endpoint);
        let e = r.get_range("packs/x.pack", 16, 41).unwrap_err();
        assert!(matches!(e, RemoteError::Corrupt { .. }), "{e}");
        let sent = sent.load(Ordering::Relaxed);
        assert!(sent < 16 << 20, "{} MiB read for 41 bytes", sent >> 20);
    }

    #[test]
    fn an_s3_ref_claiming_gigabytes_is_refused_before_reading_it() {
        let (endpoint, sent) = hostile_server(
            "HTTP/1.1 200 OK\r\nContent-Length: 3221225472\r\nETag: \"e\"\r\n\
             Last-Modified: Sun, 29 Nov 2026 18:00:00 GMT\r\n\r\n",
            64 << 20,
        );
        let r = remote_at(endpoint);
        let e = r.get_versioned("refs/heads/main").unwrap_err();
        assert!(matches!(e, RemoteError::TooLarge { .. }), "{e}");
        let e = r.get("refs/heads/main").unwrap_err();
        assert!(matches!(e, RemoteError::TooLarge { .. }), "{e}");
        let sent = sent.load(Ordering::Relaxed);
        assert!(sent < 16 << 20, "{} MiB read", sent >> 20);
    }

    /// An S3 server on a slow link: it reads a request's body and sends
    /// a GET's body `rate` bytes a second (64 KiB at a time), or with
    /// `stall` reads nothing of a body and never answers. A PUT gets 200,
    /// a ranged GET the range (zeros), anything else 404.
    fn slow_server(rate: u64, stall: bool) -> String {
        let pause = Duration::from_secs_f64((64 << 10) as f64 / rate as f64);
        serve(move |mut c| loop {
            let Some(head) = read_head(&mut c) else {
                return;
            };
            let mut body = content_length(&head) as usize;
            if stall && body > 0 {
                std::thread::sleep(Duration::from_secs(60));
                return;
            }
            let mut buf = vec![0u8; 64 << 10];
            while body > 0 {
                let n = body.min(buf.len());
                if c.read_exact(&mut buf[..n]).is_err() {
                    return;
                }
                body -= n;
                std::thread::sleep(pause);
            }
            let range = header(&head, "range: bytes=").and_then(|r| {
                let (a, b) = r.split_once('-')?;
                Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?))
            });
            let answer = if head.starts_with("put ") {
                "HTTP/1.1 200 OK\r\nETag: \"e\"\r\nContent-Length: 0\r\n\r\n".to_string()
            } else if let Some((a, b)) = range {
                format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{}\r\n\
                             Content-Length: {}\r\nETag: \"e\"\r\n\
                             Last-Modified: Sun, 29 Nov 2026 18:00:00 GMT\r\n\r\n",
                    b + 1,
                    b + 1 - a
                )
            } else {
                "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_string()
            };
            if c.write_all(answer.as_bytes()).is_err() {
                return;
            }
            if let Some((a, b)) = range {
                let mut left = (b + 1 - a) as usize;
                while left > 0 {
                    let n = left.min(buf.len());
                    if c.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    left -= n;
                    std::thread::sleep(pause);
                }
            }
        })
    }

    /// A remote on `endpoint` whose requests get `timeouts`.
    fn slow_remote(endpoint: String, timeouts: Timeouts) -> S3Remote {
        let opts = S3Options {
            endpoint: Some(endpoint),
            region: Some("us-east-1".into()),
            access_key_id: Some("k".into()),
            secret_access_key: Some("s".into()),
        };
        S3Remote::with_timeouts("bucket", "p", &opts, timeouts).unwrap()
    }

    /// A pack sent or fetched slower than the request timeout allows
    /// (here 1 s for 2-3 MiB at 512 KiB/s; in use 30 s for a 32 MiB
    /// pack on a link under 1.1 MB/s) still gets through: every PUT used
    /// to be ended after the timeout, and retried until it failed (a GET
    /// went on from where it was ended, up to its retries: five seconds,
    /// 2.5 MiB here, so the 3 MiB range needs the bulk client).
    #[test]
    fn a_pack_slower_than_the_request_timeout_gets_through() {
        let endpoint = slow_server(512 << 10, false);
        let timeouts = Timeouts {
            request: Duration::from_secs(1),
            rate: 256 << 10,
        };
        let r = slow_remote(endpoint, timeouts);
        r.put("packs/a.pack", vec![1u8; 2 << 20]).unwrap();
        let len = 3 << 20;
        let got = r.get_range("packs/a.pack", 0, len).unwrap().unwrap();
        assert_eq!(got.len() as u64, len);
        // As every PUT did: a body of the small client (1 MiB) takes 2 s
        // on that link, is ended after 1 s and retried until it fails.
        let e = r.put("packs/b.pack", vec![1u8; 1 << 20]).unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
    }

    /// A server that takes a pack's request and never reads its body
    /// ends the push after the time the pack's size is given, not never.
    #[test]
    fn a_stalled_upload_ends_when_its_time_runs_out() {
        let endpoint = slow_server(1 << 20, true);
        let timeouts = Timeouts {
            request: Duration::from_secs(1),
            rate: 4 << 20,
        };
        let r = slow_remote(endpoint, timeouts);
        let t = std::time::Instant::now();
        let e = r.put("packs/a.pack", vec![1u8; 8 << 20]).unwrap_err();
        let took = t.elapsed();
        assert!(e.to_string().contains("no answer within 3 s"), "{e}");
        assert!(took < Duration::from_secs(10), "{took:?}");
    }
}
