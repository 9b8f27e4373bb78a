// LeanStream from C++17 with sdbus-c++: open a session, call Generate (plain text, no chat
// template), print the text as it streams, close the session.
//
//   make -C examples/cpp          # generates the proxy header from the shipped XML, builds
//   target/examples-c/generate-cpp system|session|ADDRESS MODEL PROMPT
//
// The proxy classes (Manager_proxy, Session_proxy) come from the shipped introspection XML:
//   sdbus-c++-xml2cpp systemd/io.github.leanstream.LeanStream1.xml --proxy=leanstream-proxy.h
#include "leanstream-proxy.h"

#include <sdbus-c++/sdbus-c++.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>

namespace {

namespace ls = io::github::leanstream::LeanStream1;

const char* const BUS_NAME = "io.github.leanstream.LeanStream1";
const char* const MANAGER_PATH = "/io/github/leanstream/LeanStream1";

// The generated classes are mix-ins; ProxyInterfaces joins them to a proxy object. Both
// proxies share one connection: a session belongs to the connection that opened it.
class Manager final : public sdbus::ProxyInterfaces<ls::Manager_proxy> {
public:
    explicit Manager(sdbus::IConnection& bus) : ProxyInterfaces(bus, BUS_NAME, MANAGER_PATH) {
        registerProxy();
    }
    ~Manager() { unregisterProxy(); }
};

class Session final : public sdbus::ProxyInterfaces<ls::Session_proxy> {
public:
    Session(sdbus::IConnection& bus, const std::string& path)
        : ProxyInterfaces(bus, BUS_NAME, path) {
        registerProxy();
    }
    ~Session() { unregisterProxy(); }
};

// "system" and "session" are the well-known buses; anything else is a D-Bus address of a bus
// daemon (sdbus-c++ connects to it as a bus client, with fd passing, which the stream needs).
std::unique_ptr<sdbus::IConnection> connect(const std::string& address) {
    if (address == "system") return sdbus::createSystemBusConnection();
    if (address == "session") return sdbus::createSessionBusConnection();
    return sdbus::createSessionBusConnectionWithAddress(address);
}

void put_utf8(std::string& out, char32_t c) {
    if (c < 0x80) {
        out += char(c);
    } else if (c < 0x800) {
        out += char(0xC0 | (c >> 6));
        out += char(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
        out += char(0xE0 | (c >> 12));
        out += char(0x80 | ((c >> 6) & 0x3F));
        out += char(0x80 | (c & 0x3F));
    } else {
        out += char(0xF0 | (c >> 18));
        out += char(0x80 | ((c >> 12) & 0x3F));
        out += char(0x80 | ((c >> 6) & 0x3F));
        out += char(0x80 | (c & 0x3F));
    }
}

// The 4 hex digits of a \uXXXX escape at s[i], or -1.
long hex4(const std::string& s, size_t i) {
    if (i + 4 > s.size()) return -1;
    long v = 0;
    for (size_t k = i; k < i + 4; ++k) {
        char c = s[k];
        int d = c >= '0' && c <= '9' ? c - '0'
              : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10
              : -1;
        if (d < 0) return -1;
        v = v << 4 | d;
    }
    return v;
}

// The value of string member `key` of a one-line JSON event, decoded (escapes, \uXXXX and
// surrogate pairs to UTF-8); false when absent or malformed. Enough for the stream's events:
// the keys looked for come before any string value that could contain them.
bool json_string(const std::string& line, const std::string& key, std::string& out) {
    const std::string quoted = '"' + key + '"';
    for (size_t at = line.find(quoted); at != std::string::npos; at = line.find(quoted, at + 1)) {
        size_t i = line.find_first_not_of(" \t", at + quoted.size());
        if (i == std::string::npos || line[i] != ':') continue;
        i = line.find_first_not_of(" \t", i + 1);
        if (i == std::string::npos || line[i] != '"') continue;
        out.clear();
        for (++i; i < line.size(); ++i) {
            char c = line[i];
            if (c == '"') return true;
            if (c != '\\') { out += c; continue; }
            if (++i == line.size()) return false;
            switch (line[i]) {
            case '"': out += '"'; break;
            case '\\': out += '\\'; break;
            case '/': out += '/'; break;
            case 'b': out += '\b'; break;
            case 'f': out += '\f'; break;
            case 'n': out += '\n'; break;
            case 'r': out += '\r'; break;
            case 't': out += '\t'; break;
            case 'u': {
                long u = hex4(line, i + 1);
                if (u < 0) return false;
                i += 4;
                char32_t cp = char32_t(u);
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    // A high surrogate: its low half must follow as another \uXXXX.
                    long lo = line.compare(i + 1, 2, "\\u") == 0 ? hex4(line, i + 3) : -1;
                    if (lo >= 0xDC00 && lo <= 0xDFFF) {
                        cp = 0x10000 + ((cp - 0xD800) << 10) + char32_t(lo - 0xDC00);
                        i += 6;
                    } else {
                        cp = 0xFFFD;  // a lone surrogate is not a character
                    }
                } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                    cp = 0xFFFD;
                }
                put_utf8(out, cp);
                break;
            }
            default:
                return false;
            }
        }
        return false;  // no closing quote
    }
    return false;
}

// Reads the token stream until done, error or EOF, printing the text as it comes.
// Returns 0 after done, 1 after an error event or a stream cut short.
int read_stream(sdbus::UnixFd fd) {
    // release(): the FILE takes over the fd and closes it (closing it early cancels).
    std::unique_ptr<FILE, int (*)(FILE*)> stream(fdopen(fd.release(), "r"), &fclose);
    if (!stream) {
        std::perror("fdopen");
        return 1;
    }
    std::string line, value;
    bool at_line_start = true;
    for (;;) {
        // One event per line (the FILE buffers the reads).
        line.clear();
        int c;
        while ((c = std::getc(stream.get())) != EOF && c != '\n') line += char(c);
        if (c == EOF && line.empty()) break;

        if (line.rfind("{\"token\"", 0) == 0) {
            // text may be "" while a UTF-8 character is split across tokens.
            if (json_string(line, "text", value) && !value.empty()) {
                std::cout << value << std::flush;
                at_line_start = value.back() == '\n';
            }
        } else if (line.rfind("{\"done\"", 0) == 0) {
            if (!at_line_start) std::cout << '\n';
            std::cout.flush();  // the answer first, then any note on stderr
            if (json_string(line, "reason", value) && value != "eos")
                std::cerr << "(stopped: " << value << ")\n";
            return 0;
        } else if (line.rfind("{\"error\"", 0) == 0) {
            if (!at_line_start) std::cout << '\n';
            std::cout.flush();  // the answer first, then any note on stderr
            std::string name, message;
            json_string(line, "name", name);
            json_string(line, "message", message);
            std::cerr << "generation failed: " << name << ": " << message << '\n';
            return 1;
        }
        // Other events (sentence, or ones a newer daemon adds) are skipped.
    }
    if (!at_line_start) std::cout << '\n';
    std::cout.flush();
    std::cerr << "the stream ended before done (did the daemon stop?)\n";
    return 1;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 4) {
        std::cerr << "usage: " << argv[0] << " system|session|ADDRESS MODEL PROMPT\n";
        return 2;
    }
    const std::string address = argv[1], model = argv[2], prompt = argv[3];

    std::unique_ptr<sdbus::IConnection> bus;
    std::unique_ptr<Session> session;
    try {
        bus = connect(address);
        // OpenSession may load the model from storage first: allow more than the 25 s default.
        bus->setMethodCallTimeout(std::chrono::seconds(120));
        Manager manager(*bus);
        // OpenSession(s model, u context_tokens) -> o; 0 tokens = the daemon's default.
        session = std::make_unique<Session>(*bus, manager.OpenSession(model, 0));
    } catch (const sdbus::Error& e) {
        std::cerr << "OpenSession: " << e.getName() << ": " << e.getMessage() << '\n';
        return 1;
    }

    // Options a{sv}: the C++ type of each value picks its D-Bus type (uint32_t is u,
    // std::string is s). Every key is optional; an empty map means all defaults.
    std::map<std::string, sdbus::Variant> options{
        {"max_tokens", sdbus::Variant(uint32_t{64})},
        {"priority", sdbus::Variant(std::string("interactive"))},
    };

    int status;
    try {
        status = read_stream(session->Generate(prompt, options));
    } catch (const sdbus::Error& e) {
        std::cerr << "Generate: " << e.getName() << ": " << e.getMessage() << '\n';
        status = 1;
    }

    // Close frees the session's memory at once, on errors too.
    try {
        session->Close();
    } catch (const sdbus::Error& e) {
        std::cerr << "Close: " << e.getName() << ": " << e.getMessage() << '\n';
        status = 1;
    }
    return status;
}
