// Building the page from data without ever parsing data as markup.
//
// Every string a model, a tool or a user produced reaches the page through text nodes or
// attribute values set here: never innerHTML. Links are kept only for http(s) URLs.

/** An element `tag` with `props` (class, dataset, attributes, on* handlers) and `children`
 * (strings become text nodes; null, undefined and false are skipped; arrays are flattened). */
export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2).toLowerCase(), value);
    } else if (name === "class") {
      el.className = value;
    } else if (name === "dataset") {
      Object.assign(el.dataset, value);
    } else if (name === "href" || name === "src" || name === "action") {
      const safe = safeUrl(value);
      if (safe) el.setAttribute(name, safe);
    } else if (name.startsWith("on")) {
      continue; // a handler given as a string would be code: never set it
    } else if (name in el && typeof value !== "string") {
      el[name] = value; // properties such as checked, disabled, value
    } else {
      el.setAttribute(name, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

/** Append `children` to `el` as h() does. */
export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** Remove every child of `el`. */
export function clear(el) {
  el.replaceChildren();
  return el;
}

/** `url` when it is an http(s) URL or a path/fragment of this origin, else "" (no javascript:,
 * data: or other schemes in a link built from data). */
export function safeUrl(url) {
  const text = String(url ?? "");
  if (text.startsWith("#") || (text.startsWith("/") && !text.startsWith("//"))) return text;
  try {
    const parsed = new URL(text, window.location.href);
    return parsed.protocol === "http:" || parsed.protocol === "https:" ? parsed.href : "";
  } catch {
    return "";
  }
}

/** `value` as indented JSON text (for a <pre>). */
export function pretty(value) {
  try {
    return JSON.stringify(value, null, 2) ?? String(value);
  } catch {
    return String(value);
  }
}

/** An ISO 8601 time in the reader's locale, or "" when absent or unreadable. */
export function when(iso) {
  if (!iso) return "";
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? String(iso) : date.toLocaleString();
}

/** A <details> that opens to `value` as JSON: how tool inputs and outputs are shown. */
export function jsonCard(summary, value, props = {}) {
  return h("details", { class: "json", ...props }, h("summary", {}, summary), h("pre", {}, pretty(value)));
}

/** `value` (a string from the API: a name, a title, a message) in a <bdi> of its own, so that
 * right-to-left text or a bidirectional override (U+202E) in it cannot reorder the console's
 * words around it. */
export function text(value) {
  return h("bdi", { class: "data" }, String(value ?? ""));
}

// The explicit directional formatting characters (embeddings, overrides, isolates, marks).
const BIDI_CONTROLS = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/;

/** `value`, between FIRST STRONG ISOLATE and POP DIRECTIONAL ISOLATE when it holds directional
 * controls: data set inside a string of the console's own where a <bdi> cannot go (an <option>, a
 * button, a notice's sentence), so that a U+202E in it cannot reorder the words around it. */
export function isolate(value) {
  const text = String(value ?? "");
  return BIDI_CONTROLS.test(text) ? `\u2068${text}\u2069` : text;
}

/** A notice line: kind is "error", "info" or "ok"; `parts` are strings or nodes. */
export function notice(kind, ...parts) {
  return h("p", { class: `notice ${kind}`, role: kind === "error" ? "alert" : "status" }, ...parts);
}

/** Count of `n` `word`s in English: "1 integration", "2 integrations". */
export function plural(n, word, many = `${word}s`) {
  return `${Number(n).toLocaleString()} ${n === 1 ? word : many}`;
}
