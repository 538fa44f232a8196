// The HTTP API as the console calls it: JSON requests and the run's event stream.
//
// The API key and organization id live in sessionStorage: this tab only, gone when it closes.
// The stream is read with fetch(), since EventSource cannot send the Authorization header.

const STORE = "loopline.console.session";

/** A refused request: the HTTP status and the API's `detail` (or the denial envelope's reason). */
export class ApiError extends Error {
  constructor(status, detail, body) {
    super(detail || `HTTP ${status}`);
    this.status = status;
    this.detail = detail || `HTTP ${status}`;
    this.body = body;
  }
}

/** The text an answer's body gives for a refusal: `detail` (a string, or FastAPI's list), a
 * billing denial's `reason`, or the status line. */
function detailOf(status, body) {
  if (body && typeof body === "object") {
    if (typeof body.detail === "string") return body.detail;
    if (Array.isArray(body.detail)) return body.detail.map((d) => d.msg || String(d)).join("; ");
    if (typeof body.reason === "string") return body.reason;
    if (typeof body.message === "string") return body.message;
  }
  return `HTTP ${status}`;
}

export class Api {
  constructor(apiKey, organizationId) {
    this.apiKey = apiKey;
    this.organizationId = organizationId;
  }

  /** The session saved in this tab, or null. */
  static load() {
    try {
      const saved = JSON.parse(sessionStorage.getItem(STORE) || "null");
      return saved && saved.apiKey && saved.organizationId
        ? new Api(saved.apiKey, saved.organizationId)
        : null;
    } catch {
      return null;
    }
  }

  save() {
    sessionStorage.setItem(
      STORE,
      JSON.stringify({ apiKey: this.apiKey, organizationId: this.organizationId }),
    );
  }

  static forget() {
    sessionStorage.removeItem(STORE);
  }

  headers(extra = {}) {
    return {
      Authorization: `Bearer ${this.apiKey}`,
      "X-Organization-ID": this.organizationId,
      ...extra,
    };
  }

  /** `path` with `query` ({name: value}; null and undefined left out). */
  static url(path, query) {
    const params = new URLSearchParams();
    for (const [name, value] of Object.entries(query || {})) {
      if (value !== null && value !== undefined) params.set(name, String(value));
    }
    const text = params.toString();
    return text ? `${path}?${text}` : path;
  }

  /** Send a request and give its JSON answer (null for an empty one); a status >= 400 throws
   * ApiError. `body` is sent as JSON, `form` (a FormData) as multipart. */
  async request(method, path, { body, form, query, signal } = {}) {
    const init = { method, headers: this.headers({ Accept: "application/json" }), signal };
    if (form) {
      init.body = form;
    } else if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(Api.url(path, query), init);
    const text = await response.text();
    let parsed = null;
    if (text) {
      try {
        parsed = JSON.parse(text);
      } catch {
        parsed = null;
      }
    }
    if (!response.ok) throw this.refused(response.status, detailOf(response.status, parsed), parsed);
    return parsed;
  }

  /** The ApiError of a refusal; a 401 (the key was revoked or expired meanwhile) also calls
   * `this.onUnauthorized(error)` when set: the console then signs out. */
  refused(status, detail, body) {
    const error = new ApiError(status, detail, body);
    if (status === 401 && this.onUnauthorized) this.onUnauthorized(error);
    return error;
  }

  get(path, query, signal) {
    return this.request("GET", path, { query, signal });
  }

  post(path, body, signal) {
    return this.request("POST", path, { body, signal });
  }

  delete(path, query, signal) {
    return this.request("DELETE", path, { query, signal });
  }

  /** The frames of a run's stream from `after` on, as {raw, event}: `raw` the frame's text as
   * the wire carried it, `event` its parsed JSON (null when it is not JSON). Ends when the
   * server closes the stream; throws ApiError for a refused listen and TypeError/AbortError
   * for a lost connection or an abort through `signal`. */
  async *listen(chatId, runId, { after = 0, signal } = {}) {
    const path = `/assistant/chat/${encodeURIComponent(chatId)}/listen/${encodeURIComponent(runId)}`;
    const response = await fetch(Api.url(path, after ? { after } : {}), {
      headers: this.headers({ Accept: "text/event-stream" }),
      signal,
      cache: "no-store",
    });
    if (!response.ok) {
      let body = null;
      try {
        body = await response.json();
      } catch {
        body = null;
      }
      throw this.refused(response.status, detailOf(response.status, body), body);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) !== -1) {
          const raw = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const frame = parseFrame(raw);
          if (frame) yield frame;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }
}

/** One SSE frame's text -> {raw, event}; null for a frame with no data line (a comment). */
export function parseFrame(raw) {
  const data = raw
    .split("\n")
    .filter((line) => line.startsWith("data:"))
    .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5));
  if (!data.length) return null;
  let event = null;
  try {
    event = JSON.parse(data.join("\n"));
  } catch {
    event = null;
  }
  return { raw, event };
}
