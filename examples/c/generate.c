/*
 * LeanStream from C with sd-bus: open a session, send one user message with GenerateChat,
 * print the answer as it streams, close the session.
 *
 *   cc -O2 -Wall -Wextra -Werror -o generate examples/c/generate.c \
 *       $(pkg-config --cflags --libs libsystemd)
 *   ./generate system|session|ADDRESS MODEL PROMPT
 *
 * LEANSTREAM_SCHEMA='{"type":"object",...}' adds the json_schema option: the answer is then
 * JSON that matches the schema (structured output). See docs/c.md and docs/clients.md.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <systemd/sd-bus.h>

#define BUS_NAME "io.github.leanstream.LeanStream1"
#define MANAGER_PATH "/io/github/leanstream/LeanStream1"
#define MANAGER_IFACE BUS_NAME ".Manager"
#define SESSION_IFACE BUS_NAME ".Session"

/* Prints a failed call: the D-Bus error's name and message when the daemon sent one
 * (e.g. io.github.leanstream.LeanStream1.Error.ModelNotFound), else the local errno. */
static void report(const char *what, const sd_bus_error *error, int r) {
    if (sd_bus_error_is_set(error))
        fprintf(stderr, "%s: %s: %s\n", what, error->name, error->message ? error->message : "");
    else
        fprintf(stderr, "%s: %s\n", what, strerror(-r));
}

/* "system" and "session" are the well-known buses; anything else is a D-Bus address such as
 * unix:path=/run/leanstream/bus (a private bus, as the tests use). */
static int open_bus(const char *address, sd_bus **out) {
    if (strcmp(address, "system") == 0)
        return sd_bus_open_system(out);
    if (strcmp(address, "session") == 0)
        return sd_bus_open_user(out);

    sd_bus *bus = NULL;
    int r = sd_bus_new(&bus);
    if (r < 0)
        return r;
    /* bus_client: the address is a bus daemon (send Hello), not a direct peer.
     * negotiate_fds: the token stream arrives as a Unix fd; without fd passing the bus daemon
     * drops the reply and the call only ends with the timeout. */
    if ((r = sd_bus_set_address(bus, address)) < 0 || (r = sd_bus_set_bus_client(bus, 1)) < 0 ||
        (r = sd_bus_negotiate_fds(bus, 1)) < 0 || (r = sd_bus_start(bus)) < 0) {
        sd_bus_unref(bus);
        return r;
    }
    *out = bus;
    return 0;
}

/* Appends one UTF-8 encoded code point to out (room for 4 bytes is the caller's). */
static char *put_utf8(char *out, uint32_t c) {
    if (c < 0x80) {
        *out++ = (char)c;
    } else if (c < 0x800) {
        *out++ = (char)(0xC0 | (c >> 6));
        *out++ = (char)(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
        *out++ = (char)(0xE0 | (c >> 12));
        *out++ = (char)(0x80 | ((c >> 6) & 0x3F));
        *out++ = (char)(0x80 | (c & 0x3F));
    } else {
        *out++ = (char)(0xF0 | (c >> 18));
        *out++ = (char)(0x80 | ((c >> 12) & 0x3F));
        *out++ = (char)(0x80 | ((c >> 6) & 0x3F));
        *out++ = (char)(0x80 | (c & 0x3F));
    }
    return out;
}

/* Reads the 4 hex digits of a \uXXXX escape; -1 when they are not hex. */
static long hex4(const char *s) {
    long v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= c - '0';
        else if (c >= 'a' && c <= 'f')
            v |= c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            v |= c - 'A' + 10;
        else
            return -1;
    }
    return v;
}

/* Decodes the JSON string whose opening quote is at s[-1] into a new UTF-8 string (free it).
 * The daemon escapes control characters, quotes and backslashes; other text, non-ASCII
 * included, comes as UTF-8, but a JSON writer may also use \uXXXX, with a surrogate pair
 * (\uD83D\uDE00) for a character above U+FFFF, so those are decoded too. NULL if malformed. */
static char *json_unescape(const char *s) {
    char *out = malloc(strlen(s) + 1); /* decoding never grows the text */
    if (!out)
        return NULL;
    char *o = out;
    for (;;) {
        char c = *s++;
        if (c == '\0')
            goto bad; /* no closing quote */
        if (c == '"')
            break;
        if (c != '\\') {
            *o++ = c;
            continue;
        }
        switch (c = *s++) {
        case '"': *o++ = '"'; break;
        case '\\': *o++ = '\\'; break;
        case '/': *o++ = '/'; break;
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            long u = hex4(s);
            if (u < 0)
                goto bad;
            s += 4;
            uint32_t cp = (uint32_t)u;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                /* A high surrogate: the low half must follow as another \uXXXX. */
                long lo = (s[0] == '\\' && s[1] == 'u') ? hex4(s + 2) : -1;
                if (lo >= 0xDC00 && lo <= 0xDFFF) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + ((uint32_t)lo - 0xDC00);
                    s += 6;
                } else {
                    cp = 0xFFFD; /* a lone surrogate is not a character */
                }
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                cp = 0xFFFD;
            }
            /* \uXXXX is 6 input bytes and at most 3 output bytes; a pair is 12 for 4. */
            o = put_utf8(o, cp);
            break;
        }
        default:
            goto bad;
        }
    }
    *o = '\0';
    return out;
bad:
    free(out);
    return NULL;
}

/* The value of string member "key" of a one-line JSON event, decoded (free it), or NULL.
 * Enough for the stream's events: every key we look for comes before any string value that
 * could contain the same text (token: id then text; error: name then message). */
static char *json_string(const char *line, const char *key) {
    size_t n = strlen(key);
    for (const char *p = line; (p = strchr(p, '"')) != NULL; p++) {
        if (strncmp(p + 1, key, n) != 0 || p[n + 1] != '"')
            continue;
        const char *v = p + n + 2;
        v += strspn(v, " \t");
        if (*v++ != ':')
            continue;
        v += strspn(v, " \t");
        if (*v == '"')
            return json_unescape(v + 1);
    }
    return NULL;
}

/* Reads the token stream until done, error or EOF; prints the text as it comes.
 * Returns 0 after done, 1 after an error event or a stream cut short. */
static int read_stream(int fd) {
    FILE *stream = fdopen(fd, "r");
    if (!stream) {
        perror("fdopen");
        close(fd);
        return 1;
    }
    char *line = NULL;
    size_t cap = 0;
    int status = 1, ended = 0, at_line_start = 1;
    while (!ended && getline(&line, &cap, stream) > 0) {
        if (strncmp(line, "{\"token\"", 8) == 0) {
            /* text may be "" while a UTF-8 character is split across tokens. */
            char *text = json_string(line, "text");
            if (text && *text) {
                fputs(text, stdout);
                fflush(stdout); /* stream it: the user sees each token as it comes */
                at_line_start = text[strlen(text) - 1] == '\n';
            }
            free(text);
        } else if (strncmp(line, "{\"done\"", 7) == 0) {
            if (!at_line_start)
                putchar('\n');
            fflush(stdout); /* the answer first, then any note on stderr */
            /* eos: the model ended it. max_tokens, stop_string or context_full cut it short,
             * which matters for structured output: cut-off JSON does not parse. */
            char *reason = json_string(line, "reason");
            if (reason && strcmp(reason, "eos") != 0)
                fprintf(stderr, "(stopped: %s)\n", reason);
            free(reason);
            status = 0;
            ended = 1;
        } else if (strncmp(line, "{\"error\"", 8) == 0) {
            if (!at_line_start)
                putchar('\n');
            fflush(stdout); /* the answer first, then any note on stderr */
            char *name = json_string(line, "name"), *message = json_string(line, "message");
            fprintf(stderr, "generation failed: %s: %s\n", name ? name : "?",
                    message ? message : "");
            free(name);
            free(message);
            ended = 1;
        }
        /* Other events (sentence, or ones a newer daemon adds) are skipped. */
    }
    if (!ended) {
        if (!at_line_start)
            putchar('\n');
        fflush(stdout);
        fprintf(stderr, "the stream ended before done (did the daemon stop?)\n");
    }
    free(line);
    fclose(stream); /* closing the fd early would cancel the generation */
    return status;
}

/* Builds and sends GenerateChat(a(ss) messages, a{sv} options) -> h and returns the stream's
 * fd (ours to close), or -1 after printing the error. */
static int generate_chat(sd_bus *bus, const char *session, const char *prompt) {
    sd_bus_message *call = NULL, *reply = NULL;
    sd_bus_error error = SD_BUS_ERROR_NULL;
    int fd = -1, r;
    const char *schema = getenv("LEANSTREAM_SCHEMA");

    r = sd_bus_message_new_method_call(bus, &call, BUS_NAME, session, SESSION_IFACE,
                                       "GenerateChat");
    if (r < 0)
        goto fail;
    /* The conversation: one (role, content) pair. Send the whole conversation each turn. */
    r = sd_bus_message_append(call, "a(ss)", 1, "user", prompt);
    if (r < 0)
        goto fail;

    /* The options, a{sv}: every key is optional, so an empty array means all defaults.
     * Each entry is a key and a variant whose type the key fixes (docs/clients.md). */
    r = sd_bus_message_open_container(call, 'a', "{sv}");
    if (r < 0)
        goto fail;
    r = sd_bus_message_append(call, "{sv}", "max_tokens", "u", (uint32_t)64);
    if (r < 0)
        goto fail;
    r = sd_bus_message_append(call, "{sv}", "priority", "s", "interactive");
    if (r < 0)
        goto fail;
    if (schema && *schema) {
        /* Constrained decoding: the text will be JSON that matches this schema. */
        r = sd_bus_message_append(call, "{sv}", "json_schema", "s", schema);
        if (r < 0)
            goto fail;
    }
    r = sd_bus_message_close_container(call);
    if (r < 0)
        goto fail;

    r = sd_bus_call(bus, call, 0, &error, &reply);
    if (r < 0)
        goto fail;
    int borrowed;
    r = sd_bus_message_read(reply, "h", &borrowed);
    if (r < 0)
        goto fail;
    /* The fd belongs to the reply and is closed with it: keep our own copy. */
    fd = fcntl(borrowed, F_DUPFD_CLOEXEC, 3);
    if (fd < 0)
        perror("dup");
    goto done;
fail:
    report("GenerateChat", &error, r);
done:
    sd_bus_error_free(&error);
    sd_bus_message_unref(reply);
    sd_bus_message_unref(call);
    return fd;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s system|session|ADDRESS MODEL PROMPT\n", argv[0]);
        return 2;
    }
    const char *address = argv[1], *model = argv[2], *prompt = argv[3];
    sd_bus *bus = NULL;
    sd_bus_message *reply = NULL;
    sd_bus_error error = SD_BUS_ERROR_NULL;
    char *session = NULL;
    int status = 1;

    int r = open_bus(address, &bus);
    if (r < 0) {
        fprintf(stderr, "cannot connect to %s: %s\n", address, strerror(-r));
        return 1;
    }
    /* OpenSession may load the model from storage first: allow more than sd-bus's 25 s. */
    sd_bus_set_method_call_timeout(bus, 120 * 1000000ULL);

    /* OpenSession(s model, u context_tokens) -> o; 0 tokens = the daemon's default. The
     * session belongs to this connection: every call on it must use the same bus. */
    r = sd_bus_call_method(bus, BUS_NAME, MANAGER_PATH, MANAGER_IFACE, "OpenSession", &error,
                           &reply, "su", model, (uint32_t)0);
    if (r < 0) {
        report("OpenSession", &error, r);
        goto out;
    }
    const char *path;
    r = sd_bus_message_read(reply, "o", &path);
    if (r < 0) {
        report("OpenSession", &error, r);
        goto out;
    }
    session = strdup(path); /* path lives in the reply, which we drop now */
    reply = sd_bus_message_unref(reply);

    int fd = generate_chat(bus, session, prompt);
    if (fd >= 0)
        status = read_stream(fd);

    /* Close frees the session's memory at once; do it on errors too (the daemon would also
     * close it when this connection goes, but a long-lived client should not rely on that). */
    sd_bus_error_free(&error);
    r = sd_bus_call_method(bus, BUS_NAME, session, SESSION_IFACE, "Close", &error, NULL, "");
    if (r < 0) {
        report("Close", &error, r);
        status = 1;
    }
out:
    free(session);
    sd_bus_error_free(&error);
    sd_bus_message_unref(reply);
    sd_bus_flush_close_unref(bus);
    return status;
}
