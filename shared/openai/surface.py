"""Serving options of the request surface that vLLM exposes as server flags, taken by the router and by
every worker alike (both render prompts and serve the helper endpoints), so a fleet behaves as one
vLLM server started with the same flags:

- `--enable-tokenizer-info-endpoint`: `/tokenizer_info` exists (it shows the chat template);
- `--trust-request-chat-template`: a request's own `chat_template` is rendered, else refused (400);
- `--allowed-media-domains`, `--media-fetch-timeout`, `--max-media-bytes`, `--allow-private-media-urls`:
  `http(s)` image URLs (`shared/prompt/media_fetch.py`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from shared.prompt.media_fetch import DEFAULT_MAX_MEDIA_BYTES, MediaFetchLimits


@dataclass(frozen=True)
class SurfaceOptions:
    enable_tokenizer_info_endpoint: bool = False
    trust_request_chat_template: bool = False
    media: MediaFetchLimits = field(default_factory=MediaFetchLimits)


def add_surface_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags of the same names (the router and every worker take them)."""
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve /tokenizer_info (it shows the chat template and the tokenizer's configuration)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own chat_template (else such a request is a 400)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="the only hosts http(s) image URLs may name (default: any public host)")
    p.add_argument("--media-fetch-timeout", type=float, default=5.0, help="seconds one image URL may take")
    p.add_argument("--max-media-bytes", type=int, default=DEFAULT_MAX_MEDIA_BYTES,
                   help="largest image an URL may return")
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="let image URLs reach loopback, private and link-local addresses (off: SSRF guard)")
    p.add_argument("--disable-media-urls", action="store_true", help="refuse http(s) image URLs (data: URLs only)")


def surface_from_args(args: argparse.Namespace) -> SurfaceOptions:
    media = MediaFetchLimits(allowed_domains=tuple(h.lower() for h in args.allowed_media_domains),
                             timeout_s=args.media_fetch_timeout, max_bytes=args.max_media_bytes,
                             allow_private=args.allow_private_media_urls, enabled=not args.disable_media_urls)
    return SurfaceOptions(enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                          trust_request_chat_template=args.trust_request_chat_template, media=media)


def surface_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `args` again (what `kimi-pd up` hands the router and every worker it starts)."""
    argv = [flag for flag, on in (("--enable-tokenizer-info-endpoint", args.enable_tokenizer_info_endpoint),
                                  ("--trust-request-chat-template", args.trust_request_chat_template),
                                  ("--allow-private-media-urls", args.allow_private_media_urls),
                                  ("--disable-media-urls", args.disable_media_urls)) if on]
    if args.allowed_media_domains:
        argv += ["--allowed-media-domains", *args.allowed_media_domains]
    return [*argv, "--media-fetch-timeout", str(args.media_fetch_timeout),
            "--max-media-bytes", str(args.max_media_bytes)]
