//! `temper hub` (serve, tokens, benchmark), `temper login`, and the glue
//! that turns a hub reference (`owner/name@^1`) into a pulled directory
//! for `temper eval`, `temper train` and `temper env pull`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde::{Deserialize, Serialize};
use temper_env::PackageRef;
use temper_hub::{Cache, EnvRef, HubClient, HubSettings, HubState, Scope, VersionSpec};

/// `temper hub` subcommands.
#[derive(Subcommand)]
pub enum HubCommand {
    /// Run a registry: SQLite metadata + a blob directory under --dir, the
    /// HTTP API and the web page.
    Serve(ServeArgs),
    /// API tokens (run on the hub's machine, against its --dir).
    #[command(subcommand)]
    Token(TokenCommand),
}

/// `temper hub serve` flags.
#[derive(Args)]
pub struct ServeArgs {
    /// Data directory (hub.sqlite, blobs/).
    #[arg(long, default_value = "hub-data")]
    dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8700")]
    addr: String,
    /// Reads need a token too (by default anyone who reaches the hub can read).
    #[arg(long)]
    private: bool,
    /// Largest package accepted, MiB (checked against Content-Length before
    /// the upload is read, and as it streams to disk).
    #[arg(long, default_value_t = temper_hub::server::DEFAULT_MAX_PACKAGE_MB)]
    max_package_mb: usize,
}

/// `temper hub token` subcommands.
#[derive(Subcommand)]
pub enum TokenCommand {
    /// Create a token and print it (only its hash is stored).
    Create {
        /// Data directory of the hub.
        #[arg(long, default_value = "hub-data")]
        dir: PathBuf,
        /// Publish (and yank, delete) in this namespace.
        #[arg(long, conflicts_with = "read")]
        namespace: Option<String>,
        /// A read-only token (for hubs run with --private).
        #[arg(long)]
        read: bool,
        /// A note on whose token it is.
        #[arg(long, default_value = "")]
        label: String,
    },
}

/// Run `temper hub`.
pub fn run(cmd: HubCommand) -> Result<()> {
    match cmd {
        HubCommand::Serve(a) => serve(a),
        HubCommand::Token(TokenCommand::Create {
            dir,
            namespace,
            read,
            label,
        }) => {
            let scope = match (namespace, read) {
                (Some(ns), false) => {
                    if !temper_hub::package::valid_name(&ns) {
                        bail!("namespace {ns:?}: use a-z, 0-9, '-' and '_'");
                    }
                    Scope::Publish { namespace: ns }
                }
                (None, true) => Scope::Read,
                _ => bail!("give --namespace NS (publish) or --read"),
            };
            std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
            let meta = temper_hub::SqliteMeta::open(&dir.join("hub.sqlite"))?;
            let token = temper_hub::server::create_token(&meta, &scope, &label)?;
            eprintln!(
                "token with scope {} (shown once; stored hashed):",
                scope.as_string()
            );
            println!("{token}");
            Ok(())
        }
    }
}

fn serve(a: ServeArgs) -> Result<()> {
    let settings = HubSettings {
        anonymous_read: !a.private,
        max_package_bytes: a.max_package_mb.max(1) << 20,
        ..Default::default()
    };
    let state = HubState::open_dir(&a.dir, settings)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&a.addr)
            .await
            .with_context(|| format!("bind {}", a.addr))?;
        let addr = listener.local_addr()?;
        println!("listening on {addr}");
        println!("web page: http://{addr}/   data: {}", a.dir.display());
        std::io::stdout().flush()?;
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        temper_server::http::serve(
            listener,
            temper_hub::app(state),
            temper_server::http::ConnLimits::default(),
            shutdown,
        )
        .await?;
        Ok(())
    })
}

/// The default cap on one downloaded archive, MiB: the hub's own default
/// `--max-package-mb`.
pub const DEFAULT_MAX_DOWNLOAD_MB: u64 = temper_hub::server::DEFAULT_MAX_PACKAGE_MB as u64;

/// The login file: `hub.toml` in temper's config directory.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Login {
    url: String,
    token: Option<String>,
}

/// `$TEMPER_CONFIG_DIR`, else `$XDG_CONFIG_HOME/temper`, else `~/.config/temper`.
fn config_dir() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("TEMPER_CONFIG_DIR") {
        return Ok(PathBuf::from(p));
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .context("neither HOME nor XDG_CONFIG_HOME is set")?;
    Ok(base.join("temper"))
}

fn read_login() -> Result<Option<Login>> {
    let path = config_dir()?.join("hub.toml");
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(Some(
            toml::from_str(&text).with_context(|| format!("parse {}", path.display()))?,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// `temper login` flags.
#[derive(Args)]
pub struct LoginArgs {
    /// The hub's URL (`http://hub.internal:8700`).
    url: String,
    /// The API token (default: read from stdin, so it stays out of shell history).
    #[arg(long)]
    token: Option<String>,
}

/// Run `temper login`: check the token against the hub, then store URL and
/// token in `hub.toml` (mode 0600).
pub fn login(a: LoginArgs) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let token = match a.token {
        Some(t) => t,
        None => {
            eprint!("token: ");
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)?;
            line.trim().to_string()
        }
    };
    let token = Some(token).filter(|t| !t.is_empty());
    let client = HubClient::new(&a.url, token.clone());
    let scope = tokio::runtime::Runtime::new()?
        .block_on(client.whoami())
        .with_context(|| format!("cannot log in to {}", a.url))?;
    let dir = config_dir()?;
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let path = dir.join("hub.toml");
    let text = toml::to_string(&Login {
        url: a.url.trim_end_matches('/').to_string(),
        token,
    })?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("write {}", path.display()))?;
    // An existing file keeps its mode on open: tighten it.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(text.as_bytes())?;
    println!(
        "logged in to {} ({}); saved to {}",
        a.url,
        scope.as_deref().unwrap_or("anonymous"),
        path.display()
    );
    Ok(())
}

/// The hub to talk to: `--hub`, else `$TEMPER_HUB_URL`, else `temper
/// login`'s; its token from `$TEMPER_HUB_TOKEN` or the login file.
pub fn client(hub: Option<&str>) -> Result<Option<HubClient>> {
    let login = read_login()?;
    let url = hub
        .map(str::to_string)
        .or_else(|| std::env::var("TEMPER_HUB_URL").ok())
        .or_else(|| login.as_ref().map(|l| l.url.clone()));
    let Some(url) = url else {
        return Ok(None);
    };
    let token = std::env::var("TEMPER_HUB_TOKEN").ok().or_else(|| {
        login
            .filter(|l| l.url == url.trim_end_matches('/'))
            .and_then(|l| l.token)
    });
    Ok(Some(HubClient::new(&url, token)))
}

/// The pulled-package cache.
pub fn cache() -> Result<Cache> {
    Ok(Cache::new(Cache::default_root().context(
        "no cache directory: set TEMPER_HUB_CACHE or HOME",
    )?))
}

/// A progress bar for `bytes` of transfer, as a [`temper_hub::Progress`].
pub fn bar(what: &str) -> (indicatif::ProgressBar, temper_hub::Progress) {
    let pb = indicatif::ProgressBar::new(0);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    let p = pb.clone();
    let progress: temper_hub::Progress = Arc::new(move |done, total| {
        p.set_length(total);
        p.set_position(done);
    });
    (pb, progress)
}

/// Pull `r` (from the cache when it matches, unless `update`), refusing
/// an archive over `max_download_mb` MiB.
pub fn pull(
    r: &EnvRef,
    hub: Option<&str>,
    update: bool,
    quiet: bool,
    max_download_mb: u64,
) -> Result<temper_hub::Cached> {
    if max_download_mb == 0 {
        bail!("--max-download-mb must be at least 1");
    }
    let client = client(hub)?.map(|c| c.with_max_download(max_download_mb << 20));
    let cache = cache()?;
    let (pb, progress) = bar(&format!("pull {r}"));
    if quiet {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let rt = tokio::runtime::Runtime::new()?;
    let out = rt.block_on(temper_hub::pull(
        client.as_ref(),
        &cache,
        r,
        update,
        Some(progress),
    ));
    pb.finish_and_clear();
    Ok(out?)
}

/// An environment spec as `temper eval` and `temper train` take it: a hub
/// reference is pulled and becomes its directory, with the package
/// recorded. With `recorded` (a resumed run) exactly that version is used,
/// and its digest must match.
pub fn resolve_env(
    spec: &str,
    recorded: Option<&PackageRef>,
) -> Result<(String, Option<PackageRef>)> {
    let r = match recorded {
        Some(p) => EnvRef::parse(&format!("{}@{}", p.id, p.version))?,
        None if EnvRef::looks_like(spec) => EnvRef::parse(spec)?,
        None => return Ok((spec.to_string(), None)),
    };
    let c = pull(&r, None, false, false, DEFAULT_MAX_DOWNLOAD_MB)
        .with_context(|| format!("pull {r}"))?;
    if let Some(p) = recorded {
        if p.digest != c.digest {
            bail!(
                "{}@{} is {} locally but the run recorded {}",
                p.id,
                p.version,
                c.digest,
                p.digest
            );
        }
    }
    eprintln!(
        "env {} -> {}@{} {} ({})",
        recorded.map_or(spec, |p| p.reference.as_str()),
        c.id,
        c.version,
        c.digest,
        if c.from_cache { "cached" } else { "pulled" }
    );
    let package = PackageRef {
        reference: recorded.map_or(spec.to_string(), |p| p.reference.clone()),
        id: c.id.clone(),
        version: c.version.to_string(),
        digest: c.digest.clone(),
    };
    Ok((c.dir.display().to_string(), Some(package)))
}

/// `temper bench hub` flags.
#[derive(Args)]
pub struct BenchHubArgs {
    /// Size of the environment's data file, MB (random bytes: incompressible).
    #[arg(long, default_value_t = 10)]
    size_mb: usize,
    /// Pushes and pulls to time.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

/// Push and pull a `size_mb` environment through the API of an in-process
/// hub on a loopback port; print latency and throughput.
pub fn bench(a: BenchHubArgs) -> Result<()> {
    use rand::RngCore;
    let tmp = tempfile::tempdir()?;
    let env_dir = tmp.path().join("env");
    std::fs::create_dir_all(&env_dir)?;
    let mut data = vec![0u8; a.size_mb << 20];
    rand::rng().fill_bytes(&mut data);
    std::fs::write(env_dir.join("blob.bin"), &data)?;
    std::fs::write(
        env_dir.join("eval.jsonl"),
        "{\"question\": \"1+1?\", \"answer\": \"2\"}\n",
    )?;
    let rt = tokio::runtime::Runtime::new()?;
    let state = HubState::open_dir(&tmp.path().join("hub"), HubSettings::default())?;
    let token = temper_hub::server::create_token(
        state.meta.as_ref(),
        &Scope::Publish {
            namespace: "bench".into(),
        },
        "bench",
    )?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let url = format!("http://{}", listener.local_addr()?);
    rt.spawn(temper_server::http::serve(
        listener,
        temper_hub::app(state),
        temper_server::http::ConnLimits::default(),
        std::future::pending(),
    ));
    let client = HubClient::new(&url, Some(token));
    let mb = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    let (mut pack_s, mut push_s, mut pull_s, mut cached_s) = (vec![], vec![], vec![], vec![]);
    let mut size = 0;
    for round in 0..a.rounds.max(1) {
        write_bench_toml(&env_dir, round)?;
        let t = Instant::now();
        let packed = temper_hub::pack_dir(&env_dir, None)?;
        pack_s.push(t.elapsed().as_secs_f64());
        size = packed.bytes.len() as u64;
        let t = Instant::now();
        rt.block_on(client.publish(&packed.manifest, packed.bytes, None))?;
        push_s.push(t.elapsed().as_secs_f64());
        let cache = Cache::new(tmp.path().join(format!("cache{round}")));
        let r = EnvRef {
            namespace: "bench".into(),
            name: "ten-mb".into(),
            spec: VersionSpec::parse(&format!("0.0.{round}"))?,
        };
        let t = Instant::now();
        let c = rt.block_on(temper_hub::pull(Some(&client), &cache, &r, false, None))?;
        pull_s.push(t.elapsed().as_secs_f64());
        assert_pulled(&c.dir, &data)?;
        // A cached pull with no hub at all: it cannot touch the network.
        let t = Instant::now();
        let c2 = rt.block_on(temper_hub::pull(None, &cache, &r, false, None))?;
        cached_s.push(t.elapsed().as_secs_f64());
        if !c2.from_cache {
            bail!("the second pull did not come from the cache");
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (pk, pu, pl, ca) = (
        median(&mut pack_s),
        median(&mut push_s),
        median(&mut pull_s),
        median(&mut cached_s),
    );
    println!(
        "hub bench: {:.1} MiB environment ({} B archive), {} rounds, loopback HTTP, medians",
        mb(data.len() as u64),
        size,
        a.rounds.max(1)
    );
    println!("  pack         {:8.1} ms", pk * 1e3);
    println!(
        "  push         {:8.1} ms   {:7.1} MiB/s",
        pu * 1e3,
        mb(size) / pu
    );
    println!(
        "  pull         {:8.1} ms   {:7.1} MiB/s  (resolve + download + verify + unpack)",
        pl * 1e3,
        mb(size) / pl
    );
    println!(
        "  cached pull  {:8.3} ms   (no hub given: no network)",
        ca * 1e3
    );
    Ok(())
}

fn write_bench_toml(dir: &Path, round: usize) -> Result<()> {
    std::fs::write(
        dir.join("env.toml"),
        format!(
            "name = \"ten-mb\"\nnamespace = \"bench\"\nversion = \"0.0.{round}\"\n\
             description = \"benchmark payload\"\n[dataset]\neval = \"eval.jsonl\"\n\
             [[rubric]]\nfunction = \"exact_match\"\n"
        ),
    )?;
    Ok(())
}

fn assert_pulled(dir: &Path, data: &[u8]) -> Result<()> {
    let got = std::fs::read(dir.join("blob.bin"))?;
    if got != data {
        bail!("pulled bytes differ from pushed bytes");
    }
    Ok(())
}
