// Test helper for tests/io/check_hf_export.py: writes the Hugging Face tokenizer files
// of a tokenizer (train::write_hf_tokenizer, what save_hf_model writes beside the
// weights) and a config.json into a directory, and the ids tessera gives for the
// strings of the corpus files into tessera_ids.json there; a file of conversations
// (tests/fixtures/chat/chat_ids.json: objects with "messages") instead gives the ids of
// each conversation in the chat format the export's template is (io::chat_tokens).
//
//   export_hf_tokenizer TOKENIZER OUT_DIR CORPUS_OR_CHAT_JSON...
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/checkpoint/hf.hpp"
#include "tessera/io/chat.hpp"
#include "tessera/io/load_tokenizer.hpp"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: export_hf_tokenizer TOKENIZER OUT_DIR CORPUS_JSON...\n");
    return 2;
  }
  try {
    namespace fs = std::filesystem;
    const std::string spec = argv[1];
    const fs::path out = argv[2];
    fs::create_directories(out);
    const auto tok = tessera::io::load_tokenizer(spec);
    tessera::nn::ModelArgs args;
    args.vocab_size = tok->vocab_size();
    {
      std::ofstream config(out / "config.json");
      config << tessera::train::hf_config_json(args, tessera::DType::f32).dump(2) << "\n";
    }
    tessera::train::write_hf_tokenizer(tessera::io::tokenizer_file(spec), out, args.max_seq_len);
    nlohmann::json doc = {{"bos_id", tok->bos_id()},
                          {"eos_id", tok->eos_id()},
                          {"entries", nlohmann::json::array()},
                          {"chats", nlohmann::json::array()}};
    const tessera::io::ChatFormat format = tessera::io::chat_format_for(*tok);
    for (int i = 3; i < argc; ++i) {
      std::ifstream in(argv[i]);
      const nlohmann::json list = nlohmann::json::parse(in);
      if (!list.empty() && list[0].is_object()) {  // conversations
        for (const nlohmann::json& c : list) {
          if (c.at("format").get<std::string>() != tessera::io::name_of(format)) continue;
          std::vector<tessera::io::ChatMessage> messages;
          for (const nlohmann::json& m : c.at("messages"))
            messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
          const bool generation = c.at("generation_prompt").get<bool>();
          doc["chats"].push_back({{"messages", c.at("messages")},
                                  {"generation_prompt", generation},
                                  {"ids", tessera::io::chat_tokens(format, *tok, messages, "chat", generation).ids}});
        }
        continue;
      }
      for (const std::string& s : list.get<std::vector<std::string>>()) {
        using tessera::io::EncodeOptions;
        const auto ordinary = tok->encode(s, EncodeOptions{.bos = false, .eos = false, .allow_special = false});
        doc["entries"].push_back({{"text", s},
                                  {"ordinary", ordinary},
                                  {"allow_special", tok->encode(s, EncodeOptions{.allow_special = true})},
                                  {"with_bos", tok->encode(s, EncodeOptions{.bos = true, .allow_special = true})},
                                  {"decoded", tok->decode(ordinary)}});
      }
    }
    std::ofstream(out / "tessera_ids.json") << doc.dump() << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "export_hf_tokenizer: %s\n", e.what());
    return 1;
  }
  return 0;
}
