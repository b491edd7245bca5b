"""The server's images: read, admitted by the bytes they will hold, decoded and processed on a pool of their own.

A request's images are read first (their encoded bytes and headers, each
within ``multimodal.load_timeout``), so their decoded size (4 bytes a pixel)
is known before anything is decoded.  The request is then admitted against
``multimodal.max_decoded_bytes_in_flight``, counted over every request in
flight (503 past it, 400 for a request that could never fit), and only then
decoded and run through the image processor, whose output is counted too.
The bytes stay counted until the request ends: the processed pixels live as
long as it does.

All of it runs on ``multimodal.decode_threads`` threads of the server's own,
apart from the default executor that tokenizes prompts, so images in any
number never hold up a text request.  Only ``image_url`` parts are taken over
HTTP: a Python caller's ``{"type": "image", "image": PATH}`` part would read
any path on the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from patchbay.contract.settings import MultimodalSettings
from patchbay.entrypoints.chat import ChatRequestError
from patchbay.entrypoints.chat_images import ImagePart
from patchbay.entrypoints.serve.protocol import APIError
from patchbay.multimodal.images import EncodedImage, check_image_count, decode_encoded, read_encoded_url

T = TypeVar("T")


class ImageBytes:
    """Bytes a request's images hold, counted against the server's budget until :meth:`release`."""

    def __init__(self, budget: ImageBudget, held: int) -> None:
        self._budget = budget
        self.held = held
        self._released = False

    def add(self, more: int) -> None:
        """Count ``more`` bytes (the processed pixels, once known); never refused: the work is done."""
        self._budget.add(self, more)

    def release(self) -> None:
        """Give the bytes back (idempotent)."""
        self._budget.give_back(self)


class ImageBudget:
    """The bytes every request in flight holds in images, bounded by ``capacity``; thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self._lock = threading.Lock()

    def reserve(self, needed: int, field: str) -> ImageBytes:
        """Hold ``needed`` bytes for a request, or refuse it: 503 while others hold too much, 400 if it never fits."""
        if needed > self.capacity:
            raise APIError(
                400,
                f"{field}: the images decode to {needed} bytes; the server holds at most {self.capacity} "
                "(multimodal.max_decoded_bytes_in_flight): send fewer or smaller images",
                param=field,
            )
        with self._lock:
            if self.in_flight + needed > self.capacity:
                raise APIError(
                    503,
                    f"the server's images in flight are at their limit of {self.capacity} bytes "
                    "(multimodal.max_decoded_bytes_in_flight); retry later",
                    code="images_busy",
                )
            self.in_flight += needed
        return ImageBytes(self, needed)

    def add(self, held: ImageBytes, more: int) -> None:
        with self._lock:
            if not held._released:
                held.held += more
                self.in_flight += more

    def give_back(self, held: ImageBytes) -> None:
        with self._lock:
            if not held._released:
                held._released = True
                self.in_flight -= held.held


class DaemonPool:
    """``workers`` daemon threads running submitted calls in order: a call stuck in the kernel (a read on a hung
    filesystem) holds its thread, never the process's exit, as a ``ThreadPoolExecutor``'s would."""

    def __init__(self, workers: int, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True) for index in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, call: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``call`` on a free thread; its future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((call, future))
        return future

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def close(self) -> None:
        """Let each thread end once the calls before are done."""
        for _ in self._threads:
            self._calls.put(None)


class ServerImages:
    """The image pool and budget of one server."""

    def __init__(self, limits: MultimodalSettings) -> None:
        self.limits = limits
        self.budget = ImageBudget(limits.max_decoded_bytes_in_flight)
        self._pool = DaemonPool(limits.decode_threads, "patchbay-images")

    async def load(self, parts: list[ImagePart], field: str) -> tuple[list[Any], ImageBytes]:
        """Read, admit and decode a prompt's images (RGB ``PIL.Image.Image`` in order) and the bytes they hold.

        Raises :class:`~patchbay.multimodal.images.ImageInputError` naming the part at fault,
        :class:`ChatRequestError` for a part that is not an ``image_url``, or :class:`APIError` (admission,
        time limit)."""
        check_image_count(len(parts), self.limits, field)
        for part in parts:
            if not part.is_url:
                raise ChatRequestError(part.where, 'an image part over HTTP is {"type": "image_url", ...}')
        encoded = await asyncio.gather(
            *(
                self.run(part.where, read_encoded_url, part.source, limits=self.limits, where=part.where)
                for part in parts
            )
        )
        held = self.budget.reserve(sum(image.decoded_bytes for image in encoded), field)
        try:
            images = await asyncio.gather(*(self._decode(image) for image in encoded))
        except BaseException:
            held.release()
            raise
        return images, held

    async def _decode(self, image: EncodedImage) -> Any:
        return await self.run(image.where, decode_encoded, image, limits=self.limits)

    async def run(self, part: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function(*args, **kwargs)`` on the image pool, within ``multimodal.load_timeout`` (503 naming the
        request field ``part`` past it; the thread finishes in the background)."""
        future = asyncio.wrap_future(self._pool.submit(lambda: function(*args, **kwargs)))
        try:
            return await asyncio.wait_for(future, self.limits.load_timeout)
        except TimeoutError:
            raise APIError(
                503,
                f"{part}: the image was not read and decoded within {self.limits.load_timeout:g} s "
                "(multimodal.load_timeout); retry later",
                param=part,
                code="image_timeout",
            ) from None

    def close(self) -> None:
        """Stop the pool's threads once their work is done."""
        self._pool.close()
