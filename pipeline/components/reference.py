"""Component references: how a config's `component: "module.path:attribute"` becomes an object.

A reference names a callable the ordinary Python way: `module.path` is imported (from the user's
installed package, PYTHONPATH, or the working directory) and `attribute` looked up in it (dotted for
a nested one, e.g. `my_project.models:Net.small`). It is then called with the section's keyword
`args`. Nothing is evaluated from a string, and the working directory is never changed.

Every failure is a `ComponentError` naming the config key, the reference, the Python error and what
would be right: a module that can't be imported, a missing attribute, something not callable, args
the callable's signature does not take, or an exception raised while it runs.

Trust. A reference in the user's own config is imported as asked. A reference read back from an
artifact (a checkpoint's `trainserve.json` or a `model.json`, which a shared MLflow store lets
others write) is imported only when its module matches a trusted pattern (the built-ins,
$TRAINSERVE_TRUSTED_COMPONENTS, --trust, the components of the config `pipeline run` was given):
importing and calling what a store names runs code (`os:system` with args `{"command": ...}`). And
it must name what that module defines: an attribute path through another module
(`pipeline.models:resnet.torch.os.system`), a private name, or a name the module merely imported
from elsewhere is refused, so that trusting a module trusts its own classes and functions, not
everything reachable from it.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Iterable

# raised here, defined with the others
from pipeline.errors import ComponentError, ConfigError  # noqa: F401

REFERENCE = re.compile(
    r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attribute>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$"
)
BUILTIN_PATTERNS = ("pipeline.models.*", "pipeline.datasets.*")
TRUST_ENV = "TRAINSERVE_TRUSTED_COMPONENTS"


def split_reference(key: str, reference: str) -> tuple[str, str]:
    """('module.path', 'attribute') of a well-formed reference, else a ComponentError with an
    example."""
    match = REFERENCE.match(reference or "")
    if match:
        return match["module"], match["attribute"]
    hint = ""
    if reference and ":" not in reference and "." in reference:
        module, _, attribute = reference.rpartition(".")
        hint = f"; did you mean '{module}:{attribute}'?"
    raise ComponentError(
        f"{key}.component {reference!r} is not a reference of the form 'module.path:attribute' "
        f"(e.g. my_project.models:TabularNet){hint}"
    )


def resolve(
    key: str, reference: str, missing_hint: str = "", source: "ArtifactSource | None" = None
) -> Any:
    """The object `reference` names, imported the ordinary way; `missing_hint` is added when its
    module can't be found (e.g. where the run logged the code). `source`: the artifact the reference
    was read from, if it was: then it must be trusted before anything is imported (see the module
    docstring)."""
    module_name, attribute = split_reference(key, reference)
    check_trusted(key, reference, source)
    _make_working_directory_importable()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ComponentError(
                f"{key}.component '{reference}': cannot import module '{module_name}' (ModuleNotFoundError: {exc}). "
                f"Install your package (pip install -e <project>), add its directory to PYTHONPATH, or run from "
                f"the directory that holds it{missing_hint}"
            ) from None
        raise ComponentError(
            f"{key}.component '{reference}': importing '{module_name}' failed inside it "
            f"(ModuleNotFoundError: {exc})"
        ) from exc
    except Exception as exc:
        # a syntax error or an exception raised at import time in the user's module
        raise ComponentError(
            f"{key}.component '{reference}': importing '{module_name}' raised "
            f"{type(exc).__name__}: {_with_cause(exc, module_name)}"
        ) from exc
    obj: Any = module
    for depth, part in enumerate(attribute.split(".")):
        if source is not None and (part.startswith("_") or (depth and inspect.ismodule(obj))):
            raise ComponentError(
                f"{source.where} names {key}.component '{reference}': a component read from an "
                "artifact must be a public class or function of the module it names"
            )
        if not hasattr(obj, part):
            owner = ".".join([module_name, *attribute.split(".")[:depth]])
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            close = difflib.get_close_matches(part, public, n=3)
            hint = (
                f"; did you mean {', '.join(repr(c) for c in close)}?"
                if close
                else (
                    f"; it has: {', '.join(public[:15])}{' ...' if len(public) > 15 else ''}"
                    if public
                    else ""
                )
            )
            raise ComponentError(
                f"{key}.component '{reference}': '{owner}' has no attribute '{part}'{hint}"
            )
        obj = getattr(obj, part)
    if source is not None and not _defined_under(obj, module_name):
        what = (
            "a module"
            if inspect.ismodule(obj)
            else f"defined in '{getattr(obj, '__module__', '?')}'"
        )
        raise ComponentError(
            f"{source.where} names {key}.component '{reference}', which is {what}, not a class or "
            f"function of '{module_name}'; a component read from an artifact must be defined in the "
            "module it names"
        )
    if not callable(obj):
        raise ComponentError(
            f"{key}.component '{reference}' is a {type(obj).__name__}, not callable; name a class "
            "or a function"
        )
    return obj


def _defined_under(obj: Any, module_name: str) -> bool:
    """`obj` is a class or function defined in `module_name` or a module below it."""
    if inspect.ismodule(obj):
        return False
    owner = getattr(obj, "__module__", None) or ""
    return owner == module_name or owner.startswith(module_name + ".")


def call(key: str, reference: str, fn: Any, args: dict[str, Any], hint: str = "") -> Any:
    """`fn(**args)`: arguments its signature does not take (the message ends with `hint`), and
    exceptions it raises, become one ComponentError naming the key and the reference."""
    check_arguments(key, reference, fn, args, hint)
    try:
        return fn(**args)
    except ConfigError:
        raise
    except Exception as exc:
        raise ComponentError(
            f"{key}.component '{reference}' raised {type(exc).__name__}: "
            f"{_with_cause(exc, reference.partition(':')[0])}"
        ) from exc


# An extension built against another torch than the installed one: its operators can't register, its
# symbols don't resolve (torchvision from the registry, a CUDA build, under a CPU torch: "operator
# torchvision::nms does not exist").
_BUILT_FOR_ANOTHER_TORCH = re.compile(
    r"operator \S+ does not exist|undefined symbol|compiled (with|against|for) "
    r"(a )?(different|another|torch|pytorch)",
    re.IGNORECASE,
)


def _with_cause(exc: BaseException, module_name: str) -> str:
    """`exc`'s text, and when an import deep inside it failed in another installed package (a broken
    optional package: transformers says only "Could not import module 'BertForTokenClassification'",
    whatever the reason), that failure and its fix: the one thing the user must act on, which the
    outer message hides."""
    root = exc
    while (
        nxt := root.__cause__ or (None if root.__suppress_context__ else root.__context__)
    ) is not None:
        root = nxt
    # the modules being imported when it was raised, outermost first
    bodies = [
        f.f_globals.get("__name__", "")
        for f, _ in traceback.walk_tb(root.__traceback__)
        if f.f_code.co_name == "<module>"
    ]
    package = bodies[-1].partition(".")[0] if bodies else ""
    text = str(exc).strip() or type(exc).__name__
    if not package or package in ("__main__", "importlib"):
        return text
    dist = next(iter(importlib.metadata.packages_distributions().get(package, [])), None)
    version = _installed_version(dist) if dist else None
    # not an installed package: the user's own code, said as it is
    if version is None:
        return text
    same = package == module_name.partition(".")[0]
    built_for_another_torch = _BUILT_FOR_ANOTHER_TORCH.search(str(root))
    # the named package's own failure: its text says it
    if same and not built_for_another_torch:
        return text
    cause = (
        ""
        if same and root is exc
        else (
            f"{text.split('. ')[0].rstrip('.')}, because importing {package} failed: {type(root).__name__}: "
            f"{str(root).strip().splitlines()[0] if str(root).strip() else ''}"
        )
    )
    if built_for_another_torch:
        fix = (
            f"{dist} {version} was built for another torch than the installed {_installed_version('torch')}: "
            + (
                "scripts/setup --with torchvision installs one that fits (or says why none can here)"
                if dist == "torchvision"
                else f"reinstall it for this torch (pip install -c .venv/constraints.txt {dist})"
            )
            + f", or uninstall it: pip uninstall {dist}"
        )
    else:
        fix = (
            f"{dist} {version} is installed but can't be imported: repair it (pip install --force-reinstall -c "
            f".venv/constraints.txt {dist}) or uninstall it (pip uninstall {dist})"
        )
    return f"{cause or text}; {fix}"


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_arguments(
    key: str, reference: str, fn: Any, args: dict[str, Any], hint: str = ""
) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        # some builtins have no signature: let the call speak
        return
    try:
        signature.bind(**args)
    except TypeError as exc:
        given = ", ".join(sorted(args)) or "none"
        # a required parameter: the data may be what should give it
        missing = "missing" in str(exc)
        closest = _closest(args, signature)
        raise ComponentError(
            f"{key}.args do not fit {reference}{plain_signature(signature)}: {exc}"
            f"{closest} (given: {given}); set {key}.args to what it takes"
            f"{hint if missing else ''}{'' if closest else _replacement(key, args, signature)}"
        ) from None


def _replacement(key: str, args: dict[str, Any], signature: inspect.Signature) -> str:
    """ ": 'data.args={root: DIR}' on the command line replaces the whole mapping ..." when `args` hold keys
    the signature does not take: the override that drops them. A dotted override
    (data.args.root=DIR) sets one key and keeps the config file's others, which is how a stray key
    usually gets in."""
    import shlex

    import yaml

    parameters = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return ""
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    kept = {k: v for k, v in args.items() if k in names}
    if len(kept) == len(args):
        return ""
    try:
        mapping = yaml.safe_dump(kept, default_flow_style=True, width=1 << 30).strip()
    except yaml.YAMLError:
        # not plain values: no override can be written for them
        return ""
    return (
        f": {shlex.quote(f'{key}.args={mapping}')} on the command line replaces the whole mapping "
        f"({key}.args.NAME=VALUE sets one key and keeps the others)"
    )


def _closest(args: dict[str, Any], signature: inspect.Signature) -> str:
    """ "; did you mean 'hidden'?" for an argument name close to a parameter's."""
    names = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    close = [
        c
        for given in args
        if given not in names
        for c in difflib.get_close_matches(given, names, n=1)
    ]
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def plain_signature(signature: inspect.Signature) -> inspect.Signature:
    """The parameters without annotations: what a message needs, and readable."""
    return signature.replace(
        parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
        return_annotation=signature.empty,
    )


def accepted_parameters(fn: Any) -> set[str]:
    """Names `fn` takes as keywords (empty when it has no inspectable signature)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def takes_kwargs(fn: Any) -> bool:
    """Whether `fn` takes **kwargs (and so keywords it does not name)."""
    try:
        return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class ArtifactSource:
    """Where references were read back from (a checkpoint, a model.json), and the patterns this
    process trusts besides the built-ins and $TRAINSERVE_TRUSTED_COMPONENTS (e.g. the config
    `pipeline run` was given)."""

    where: str
    trusted: tuple[str, ...] = ()


def trusted_patterns(extra: Iterable[str] = ()) -> list[str]:
    """The built-ins, $TRAINSERVE_TRUSTED_COMPONENTS and `extra` (--trust, each repeatable): all of
    them comma-separated lists, read the same way."""
    return [
        *BUILTIN_PATTERNS,
        *split_patterns(os.environ.get(TRUST_ENV, "")),
        *split_patterns(*extra),
    ]


def split_patterns(*texts: str) -> list[str]:
    """`'my_project.*, timm.*'` -> ['my_project.*', 'timm.*']."""
    return [p.strip() for text in texts for p in text.split(",") if p.strip()]


def matches(reference: str, pattern: str) -> bool:
    """`pattern` is `module-glob` or `module-glob:attribute-glob`; the module glob is matched
    against the module alone (`my_project.*` is any module below my_project), never across the
    colon."""
    module, _, attribute = reference.partition(":")
    module_glob, _, attribute_glob = pattern.partition(":")
    return (
        fnmatch.fnmatchcase(module, module_glob)
        or (module_glob.endswith(".*") and module == module_glob[:-2])
    ) and fnmatch.fnmatchcase(attribute, attribute_glob or "*")


def check_trusted(key: str, reference: str, source: ArtifactSource | None) -> None:
    """Refuses a reference read from an artifact unless its module is built in or explicitly
    trusted; `source` None means the reference came from the user's own config."""
    check_all_trusted({key: reference}, source)


def check_all_trusted(references: dict[str, str], source: ArtifactSource | None) -> None:
    """`check_trusted` for every component an artifact names ({key: reference}) at once: the refusal
    lists all the untrusted ones with one `--trust` that covers them, so the next refusal does not
    follow the fix."""
    if source is None:
        return
    patterns = trusted_patterns(source.trusted)
    untrusted = {
        k: r for k, r in references.items() if r and not any(matches(r, p) for p in patterns)
    }
    if not untrusted:
        return
    named = ", ".join(f"{key}.component '{reference}'" for key, reference in untrusted.items())
    them = ",".join(dict.fromkeys(untrusted.values()))
    raise ComponentError(
        f"{source.where} names {named}, which {'is' if len(untrusted) == 1 else 'are'} not trusted here: a "
        f"component named by an artifact is imported and run only when it is built in or matches ${TRUST_ENV} or "
        f"--trust (comma-separated patterns such as 'my_project.*'), because a shared store could name any "
        f"callable. If you trust the run that wrote {'it' if len(untrusted) == 1 else 'them'}: "
        f"--trust '{them}' (or {TRUST_ENV}='{them}')"
    )


def recorded_components(*sections: Any) -> dict[str, str]:
    """{key: reference} of config sections that name a component (each has KEY and component; None
    skipped)."""
    return {s.KEY: s.component for s in sections if s is not None and getattr(s, "component", None)}


# Arguments by which a factory names the model it builds: timm's create_model(model_name=...),
# Hugging Face's from_pretrained(pretrained_model_name_or_path=...), torchvision's
# get_model(name=...).
NAMING_ARGS = ("model_name", "pretrained_model_name_or_path", "arch", "architecture", "name")
FACTORY = re.compile(r"^(create|make|build|get|load|new)(_|$)")


def model_short_name(reference: str, args: dict[str, Any] | None = None) -> str:
    """A name for runs: the model a factory builds (`timm:create_model` with model_name resnet10t ->
    `resnet10t`, `transformers:AutoModel.from_pretrained` with a path -> its last part), else
    `short_name`."""
    attribute = reference.rpartition(":")[2].rpartition(".")[2]
    named = next(
        (v for k in NAMING_ARGS if isinstance(v := (args or {}).get(k), str) and v.strip()), None
    )
    if named and (FACTORY.match(attribute.lower()) or attribute.startswith("from_")):
        last = named.rstrip("/").rpartition("/")[2].lower()
        return re.sub(r"[^a-z0-9]+", "-", last).strip("-") or short_name(reference)
    return short_name(reference)


def short_name(reference: str) -> str:
    """`my_project.models:TabularNet` -> `tabularnet`: a name for runs and registered models."""
    attribute = reference.rpartition(":")[2].rpartition(".")[2]
    return re.sub(r"[^a-z0-9]+", "-", attribute.lower()).strip("-") or "model"


def _make_working_directory_importable() -> None:
    """`python -m` puts the working directory first on sys.path, a console script (`pipeline`) does
    not; the contract says a component may live there. Appended, so it shadows no installed
    package."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
