// Small pieces the organization's panels share: refusals as notices, tables, forms, an inline
// confirmation and a button that stays disabled while its request runs.
//
// Every string from the API goes through h() (text nodes and attribute values): never markup.

import { ApiError } from "./api.js";
import { append, h, notice, when } from "./dom.js";

/** The words for a refused or failed request: the status and the API's detail, with a hint for
 * the statuses a user can act on (403: a role, 503: try again). */
export function describe(error) {
  if (!(error instanceof ApiError)) {
    if (error && error.name === "AbortError") return "Cancelled.";
    return "The gateway cannot be reached.";
  }
  const hints = {
    403: "Your role in this organization cannot do this",
    404: "Not found",
    413: "Too large",
    415: "Unsupported file type",
    429: "Too many requests",
    503: "A service is unavailable; try again shortly",
  };
  const hint = hints[error.status];
  return hint ? `${error.status} ${hint}: ${error.detail}` : `${error.status}: ${error.detail}`;
}

/** A notice for `error` (see describe). */
export function refusal(error) {
  return notice("error", describe(error));
}

/** Fill `el` with "Loading…", then with render(result of load()), or with the refusal. The
 * returned promise never rejects; `signal` aborted means the view is gone (nothing is drawn). */
export async function fill(el, load, render, signal) {
  el.replaceChildren(h("p", { class: "muted loading" }, "Loading…"));
  let result;
  try {
    result = await load();
  } catch (error) {
    if (signal && signal.aborted) return;
    el.replaceChildren(refusal(error));
    return;
  }
  if (signal && signal.aborted) return;
  el.replaceChildren();
  append(el, [render(result)]);
}

/** Run `action` with `button` disabled meanwhile; a failure goes into `status` as a notice
 * (cleared first). Gives action's result, or undefined when it failed. */
export async function busy(button, status, action) {
  if (status) status.replaceChildren();
  button.disabled = true;
  try {
    return await action();
  } catch (error) {
    if (status) status.replaceChildren(refusal(error));
    return undefined;
  } finally {
    button.disabled = false;
  }
}

/** A table (in a sideways-scrolling wrapper) of `rows` (arrays of cells: strings or nodes) under `headings`; `empty` when none. */
export function table(headings, rows, empty, props = {}) {
  if (!rows.length) return h("p", { class: "muted empty" }, empty);
  return scroller(
    "table",
    props,
    h("thead", {}, h("tr", {}, headings.map((name) => h("th", { scope: "col" }, name)))),
    h(
      "tbody",
      {},
      rows.map((row) => (row instanceof Node ? row : h("tr", {}, row.map((cell) => h("td", {}, cell))))),
    ),
  );
}

/** h(...args) inside a wrapper that scrolls sideways: a wide table scrolls within its card
 * instead of widening the page (a phone's width). */
export function scroller(...args) {
  return h("div", { class: "table-wrap" }, h(...args));
}

/** A labelled control, with an optional hint line under it. */
export function field(label, control, hint) {
  return h("label", {}, label, control, hint ? h("span", { class: "hint" }, hint) : null);
}

/** A button that asks again in place ("Delete x?" + confirm/cancel) before running `action`. */
export function confirmButton(label, question, action, { danger = true } = {}) {
  const box = h("span", { class: "confirm" });
  const first = h("button", { type: "button", class: "secondary small" }, label);
  const show = (...nodes) => box.replaceChildren(...nodes);
  first.addEventListener("click", () => {
    const yes = h(
      "button",
      { type: "button", class: danger ? "danger small" : "small" },
      `Yes, ${label.toLowerCase()}`,
    );
    const no = h("button", { type: "button", class: "secondary small" }, "Cancel");
    no.addEventListener("click", () => show(first));
    yes.addEventListener("click", async () => {
      yes.disabled = no.disabled = true;
      await action();
      if (box.isConnected) show(first);
    });
    show(h("span", { class: "question" }, question), yes, no);
    yes.focus();
  });
  show(first);
  return box;
}

/** A time for a table cell: the reader's locale, with the ISO text as its tooltip; "—" if none. */
export function time(iso) {
  return iso ? h("time", { datetime: iso, title: iso }, when(iso)) : h("span", { class: "muted" }, "—");
}

/** A heading row for a panel: the title, a short explanation and optional buttons. */
export function header(title, text, ...buttons) {
  return h(
    "div",
    { class: "panel-head" },
    h("div", { class: "grow" }, h("h1", {}, title), text ? h("p", { class: "hint" }, text) : null),
    buttons,
  );
}

/** A date input's value (YYYY-MM-DD) as the end of that day in the reader's time zone, ISO 8601;
 * null when empty. */
export function endOfDay(value) {
  if (!value) return null;
  const date = new Date(`${value}T23:59:59`);
  return Number.isNaN(date.getTime()) ? null : date.toISOString();
}

/** An AbortController whose abort is the view's cleanup. */
export function viewSignal() {
  const controller = new AbortController();
  return { signal: controller.signal, cleanup: () => controller.abort() };
}
