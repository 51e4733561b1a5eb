"""Per-layer quantization recipes: a default spec plus overrides by layer-name pattern.

A recipe is a JSON or YAML file:

    default: {bits: 4, group_size: 128, zero_point: true}
    overrides:                      # first matching pattern wins
      "model.layers.0.*": {bits: 8}
      "*.mlp.down_proj": {bits: 16}  # 16: keep this layer in floating point

Patterns are shell-style globs (`fnmatch`) matched against layer names such as
`model.layers.3.self_attn.q_proj`; an override inherits from `default` what it does not set.
Layers fused at load time (q/k/v, gate/up) get one spec: the most precise among their members.
The token embedding and LM head (`model.embed_tokens`, `lm_head`) stay in floating point unless
an override names them (`"lm_head": {bits: 4}`); they are quantized round-to-nearest.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tandem.formats.weight import SUPPORTED_GROUP_SIZES, LayerSpec
from tandem.model.layer_names import FUSED_GROUPS, linear_layer_names

SPEC_KEYS = ("bits", "group_size", "zero_point")
SUPPORTED_RECIPE_BITS = (4, 8, 16)


class RecipeError(ValueError):
    """A recipe file or dict that cannot be used; the message names the file and the key."""


@dataclass
class Recipe:
    default: LayerSpec = field(default_factory=LayerSpec)
    overrides: list[tuple[str, LayerSpec]] = field(default_factory=list)

    def spec_for(self, name: str) -> LayerSpec:
        """The spec of layer `name` (no `.weight` suffix): the first matching override, else default."""
        for pattern, spec in self.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                return spec
        return self.default

    def check_patterns(self, names: list[str]) -> None:
        """Raise RecipeError for a pattern that matches none of `names` (a likely typo)."""
        for pattern, _ in self.overrides:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                example = names[0] if names else "model.layers.0.mlp.down_proj"
                raise RecipeError(
                    f"recipe override {pattern!r} matches no quantizable layer "
                    f"(layer names look like {example!r})"
                )

    def to_dict(self) -> dict[str, Any]:
        return {
            "default": asdict(self.default),
            "overrides": {p: asdict(s) for p, s in self.overrides},
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "recipe") -> Recipe:
        if not isinstance(data, dict):
            raise RecipeError(
                f"{source}: a recipe must be a mapping with 'default' and/or 'overrides'"
            )
        unknown = sorted(set(data) - {"default", "overrides"})
        if unknown:
            raise RecipeError(
                f"{source}: unknown top-level key(s) {', '.join(map(repr, unknown))}; "
                "expected 'default' and 'overrides'"
            )
        default = _spec(data.get("default", {}), LayerSpec(), f"{source}: default")
        overrides_raw = data.get("overrides", {}) or {}
        if not isinstance(overrides_raw, dict):
            raise RecipeError(
                f"{source}: overrides must be a mapping of layer-name pattern to spec, "
                f"got {type(overrides_raw).__name__}"
            )
        overrides = []
        for pattern, spec in overrides_raw.items():
            if not isinstance(pattern, str) or not pattern.strip():
                raise RecipeError(
                    f"{source}: override pattern {pattern!r} must be a non-empty string"
                )
            overrides.append((pattern, _spec(spec, default, f"{source}: overrides[{pattern!r}]")))
        return cls(default, overrides)

    @classmethod
    def load(cls, path: str) -> Recipe:
        """Read a recipe from a .json, .yaml or .yml file."""
        if not os.path.isfile(path):
            raise RecipeError(f"recipe file {path!r} does not exist")
        with open(path) as f:
            text = f.read()
        if path.endswith((".yaml", ".yml")):
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise RecipeError(f"{path}: not valid YAML: {e}") from e
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise RecipeError(
                    f"{path}: not valid JSON ({e}); YAML recipes need a .yaml or .yml name"
                ) from e
        return cls.from_dict(data, path)


def _spec(raw: Any, base: LayerSpec, where: str) -> LayerSpec:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{where} must be a mapping like {{bits: 4, group_size: 128}}, got {raw!r}"
        )
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise RecipeError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"a spec has {', '.join(SPEC_KEYS)}"
        )
    spec = replace(base, **raw)
    if isinstance(spec.bits, bool) or spec.bits not in SUPPORTED_RECIPE_BITS:
        raise RecipeError(f"{where}.bits must be 4, 8 or 16, got {spec.bits!r}")
    if isinstance(spec.group_size, bool) or spec.group_size not in SUPPORTED_GROUP_SIZES:
        raise RecipeError(
            f"{where}.group_size must be one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))}, "
            f"got {spec.group_size!r}"
        )
    if not isinstance(spec.zero_point, bool):
        raise RecipeError(f"{where}.zero_point must be true or false, got {spec.zero_point!r}")
    return spec


# The token embedding and the LM head: quantized only where an override names them.
HEAD_LAYERS = ("model.embed_tokens", "lm_head")


def head_specs(recipe: Recipe, tied: bool) -> dict[str, LayerSpec]:
    """Specs of the token embedding and the LM head, for those the recipe quantizes.

    The default spec does not reach them (they stay in floating point, as the usual toolkits
    leave them); an override whose pattern matches one does, e.g. `"lm_head": {bits: 4}` or
    `"model.embed_tokens": {bits: 8}`. A model with tied embeddings has one table, stored as
    `model.embed_tokens`: it takes the more precise of the two specs.
    """
    out: dict[str, LayerSpec] = {}
    for name in HEAD_LAYERS:
        for pattern, spec in recipe.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = spec
                break
    if tied and "lm_head" in out:
        head = out.pop("lm_head")
        table = out.get("model.embed_tokens", head)
        out["model.embed_tokens"] = max(head, table, key=LayerSpec.precision_key)
    return {n: s for n, s in out.items() if s.quantized}


def resolve_specs(recipe: Recipe, num_layers: int) -> dict[str, LayerSpec]:
    """Spec of every quantizable decoder layer, fused groups promoted to their most precise
    member (the embedding and LM head: `head_specs`)."""
    names = linear_layer_names(num_layers)
    recipe.check_patterns(names + list(HEAD_LAYERS))
    out: dict[str, LayerSpec] = {}
    for i in range(num_layers):
        for parts in FUSED_GROUPS.values():
            members = [f"model.layers.{i}.{p}" for p in parts]
            best = max((recipe.spec_for(n) for n in members), key=LayerSpec.precision_key)
            for n in members:
                out[n] = best
    return out
