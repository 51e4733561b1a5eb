"""The dependency set resolves where users are: `uv pip compile pyproject.toml` with every extra
for Linux x86_64 (the index's default torch, a CUDA build), Linux aarch64 and macOS arm64.

`--no-config` keeps this machine's settings (a local CPU torch wheel, constraints) out of it:
the answer is what a user's fresh `pip install` would meet. It asks the package index, through
uv's cache on repeated runs; with no index reachable it fails, saying so, and never passes
without a resolution.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "3.11"  # requires-python's floor

# platform -> extra environment for uv. torch 2.13.0's macOS wheels are tagged macosx_14_0_arm64,
# and uv assumes macOS 13.0 for aarch64-apple-darwin unless given the deployment target.
PLATFORMS = {
    "x86_64-manylinux_2_28": {},
    "aarch64-manylinux_2_28": {},
    "aarch64-apple-darwin": {"MACOSX_DEPLOYMENT_TARGET": "14.0"},
}
# What uv says when it cannot reach the index (as opposed to an unsatisfiable set).
_NETWORK = re.compile(
    r"error sending request|failed to fetch|dns error|connect(ion)? (error|refused|timed out)"
    r"|network is unreachable|temporary failure in name resolution|operation timed out",
    re.I,
)


def _uv() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        pytest.fail("uv is not installed: it is in the dev extra (pip install -e '.[dev]')")
    return find_uv_bin()


def compile_for(
    platform: str, inputs: tuple[str, ...] = ("pyproject.toml", "--all-extras")
) -> dict[str, tuple[str, set[str]]]:
    """`uv pip compile` for one platform: {package: (version, the packages that require it)}."""
    cmd = [_uv(), "pip", "compile", *inputs, "--no-config"]
    cmd += ["--python-platform", platform, "--python-version", PYTHON, "--no-header", "--quiet"]
    env = {**os.environ, **PLATFORMS[platform]}
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"uv pip compile for {platform} took over 240 s: is the package index slow?")
    if r.returncode != 0:
        if _NETWORK.search(r.stderr):
            pytest.fail(
                f"the package index could not be reached, so nothing was resolved for "
                f"{platform} (this test needs the index or a warm uv cache):\n{r.stderr}"
            )
        pytest.fail(f"the dependencies do not resolve for {platform}:\n{r.stderr}")
    # Output: `name==version` lines, each followed by `# via X` or `# via` and `#   X` lines.
    out: dict[str, tuple[str, set[str]]] = {}
    name = None
    for line in r.stdout.splitlines():
        if m := re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.strip()):
            name = m.group(1).lower().replace("_", "-")
            out[name] = (m.group(2), set())
        elif name and (
            m := re.fullmatch(r"#\s+(?:via\s+)?([A-Za-z0-9._-]+)(?: \(.*\))?", line.strip())
        ):
            out[name][1].add(m.group(1).lower())
    assert out, f"uv printed no resolution for {platform}:\n{r.stdout}\n{r.stderr}"
    return out


def _torch_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"torch\s*==", d)]
    return pin.split("==")[1].split(";")[0].strip()


@pytest.fixture(scope="module")
def resolved():
    cache: dict[str, dict] = {}

    def get(platform: str):
        if platform not in cache:
            cache[platform] = compile_for(platform)
        return cache[platform]

    return get


@pytest.mark.parametrize("platform", list(PLATFORMS))
def test_dependencies_resolve(resolved, platform):
    pkgs = resolved(platform)
    assert pkgs["torch"][0] == _torch_pin(), pkgs["torch"]
    assert "uv" in pkgs, "the dev extra (uv runs this test)"


def test_linux_x86_64_gets_the_cuda_torch_and_its_triton(resolved):
    pkgs = resolved("x86_64-manylinux_2_28")
    # The index's torch for Linux is a CUDA build: it requires CUDA wheels (cuDNN, the CUDA
    # toolkit's runtime, ...) ...
    cuda = [
        n for n, (_, via) in pkgs.items() if "torch" in via and n.startswith(("nvidia-", "cuda-"))
    ]
    assert cuda and any(n.startswith("nvidia-cuda-runtime") for n in pkgs), sorted(pkgs)
    # ... and pins its own triton, which pyproject.toml must not contradict.
    assert "triton" in pkgs and "torch" in pkgs["triton"][1], pkgs.get("triton")
    assert "nixl-cu13" in pkgs


def test_linux_aarch64_gets_triton(resolved):
    pkgs = resolved("aarch64-manylinux_2_28")
    assert "triton" in pkgs and "torch" in pkgs["triton"][1], pkgs.get("triton")


def test_macos_resolves_without_triton_or_nixl(resolved):
    pkgs = resolved("aarch64-apple-darwin")
    # No wheels of either exist for macOS: the kernels' torch references run there.
    for name in ("triton", "nixl-cu13"):
        assert name not in pkgs, name
    assert not [n for n in pkgs if n.startswith("nvidia-")]


def test_the_docker_image_dependencies_resolve_on_the_cuda_base(resolved, tmp_path):
    # The Dockerfile installs the dependencies and the nixl extra minus torch, constrained to
    # the base image's torch and triton: PyTorch's CUDA image has the index's torch 2.13.0 and
    # the triton it pins, so that set must resolve around them without moving either.
    cuda = resolved("x86_64-manylinux_2_28")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["nixl"]
    keep = [d for d in deps if re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() != "torch"]
    (tmp_path / "requirements.txt").write_text("\n".join(keep) + "\n")
    pins = {name: cuda[name][0] for name in ("torch", "triton")}
    (tmp_path / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    image = compile_for(
        "x86_64-manylinux_2_28",
        (str(tmp_path / "requirements.txt"), "-c", str(tmp_path / "constraints.txt")),
    )
    for name, version in pins.items():
        if name in image:  # torch arrives only through a requirement that needs it (nixl-cu13)
            assert image[name][0] == version, (name, image[name])
    assert "triton" in image and "nixl-cu13" in image
